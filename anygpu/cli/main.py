"""The ``anygpu`` command.

    anygpu devices            list every device of every backend, with a self-test each
    anygpu demo [--device D]  train a small CNN on handwritten digits
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

import numpy as np

from anygpu import config


def _self_test(device: str) -> str:
    """A fused multiply-add-relu-sum on the device, checked against NumPy."""
    import anygpu as ag

    rng = np.random.default_rng()
    a, b, c = (rng.standard_normal((64, 256)).astype(np.float32) for _ in range(3))
    start = time.perf_counter()
    out = ((ag.tensor(a, device=device) * ag.tensor(b, device=device)
            + ag.tensor(c, device=device)).relu().sum(1)).numpy()
    seconds = time.perf_counter() - start
    ref = np.maximum(a * b + c, 0).sum(1)
    if not np.allclose(out, ref, rtol=1e-4, atol=1e-4):
        return f"FAILED (max error {np.abs(out - ref).max():.3g})"
    return f"ok ({seconds * 1e3:.0f} ms incl. compile)"


def cmd_devices(args: argparse.Namespace) -> int:
    from anygpu.runtime.registry import BACKENDS, BackendUnavailable, backend_module, get_device

    failed = False
    for backend in BACKENDS:
        try:
            count = backend_module(backend).device_count()
        except BackendUnavailable as err:
            print(f"{backend:7s} unavailable: {err}")
            continue
        except Exception as err:  # a broken driver must not hide the other backends
            print(f"{backend:7s} unavailable: {type(err).__name__}: {err}")
            continue
        for i in range(count):
            name = f"{backend}:{i}"
            try:
                dev = get_device(name)
                info = dev.info
                mem = f"{info.memory / 2**30:.1f} GiB" if info.memory else "memory unknown"
                units = f"{info.compute_units} compute units" if info.compute_units else ""
                print(f"{name:9s} {info.name} | {mem} | {units} | {info.driver}")
                result = _self_test(name) if not args.no_test else "not tested"
            except Exception as err:
                result = f"FAILED: {type(err).__name__}: {err}"
            failed |= result.startswith("FAILED")
            print(f"{'':9s} self-test: {result}")
    return 1 if failed else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from anygpu.cli.demo import run

    accuracy = run(args.device, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr)
    return 0 if accuracy > 0.9 else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="anygpu", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="environment variables:\n" + "\n".join(
                                         f"  {k}: {v}" for k, v in config.variables().items()))
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("devices", help="list devices of every backend with a self-test")
    p.add_argument("--no-test", action="store_true", help="skip the self-test")
    p.set_defaults(func=cmd_devices)
    p = sub.add_parser("demo", help="train a small CNN on handwritten digits")
    p.add_argument("--device", default=None,
                   help='e.g. "cpu", "opencl", "cuda:0", "webgpu" (default: the best available)')
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.set_defaults(func=cmd_demo)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
