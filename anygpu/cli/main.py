"""The ``anygpu`` command.

    anygpu devices            list every device of every backend, with a self-test each
    anygpu demo [--device D]  train a small CNN on handwritten digits
    anygpu tune TARGET...     pre-tune the products and convolutions of a model on a GPU
    anygpu bench train|infer  time a CNN's training step or inference beside PyTorch
    anygpu bench llm          a language model's prefill and decode, and the roofline share
    anygpu run MODEL.onnx     run an ONNX model (random or given inputs), compare, time
    anygpu generate FOLDER    continue a prompt with a local language model
    anygpu chat FOLDER        chat with a local language model
    anygpu serve FOLDER       an OpenAI-compatible server for a local language model
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

import numpy as np

from anygpu import config
from anygpu.cli import bench
from anygpu.cli import run as run_cmd
from anygpu.llm import cli as llm_cmd


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
        for reason in getattr(backend_module(backend), "LEFT_OUT", ()):
            print(f"{backend:7s} left out: {reason}")
    return 1 if failed else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from anygpu.cli.demo import run

    accuracy = run(args.device, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr)
    return 0 if accuracy > 0.9 else 1


def cmd_tune(args: argparse.Namespace) -> int:
    import anygpu as ag
    from anygpu import tune
    from anygpu.runtime.registry import get_device
    from anygpu.tune import targets

    device = get_device(args.device)  # fails here, with the reason, if the device cannot open
    dtype = {"fp32": ag.float32, "tf32": ag.float32, "fp16": ag.float16,
             "bf16": ag.bfloat16}[args.precision]
    ag.set_float32_matmul_precision("high" if args.precision == "tf32" else "highest")
    try:
        work = [t for spec in args.targets
                for t in targets.parse(spec, args.batch, args.device, dtype)]
    except ValueError as err:
        print(f"anygpu tune: {err}", file=sys.stderr)
        return 2
    if device.dialect == "c":
        print("the cpu backend has nothing to tune: its products go through BLAS")
        return 0
    tune.forced = args.level
    start = time.monotonic()
    tune.deadline = start + args.time_limit if args.time_limit else None
    print(f"tuning {len(work)} target(s) on {device.name} ({device.info.name}), level "
          f"{args.level}, {args.precision}; winners go to {config.get().cache_path / 'tuning'}")
    done = 0

    def report(record: tune.Record) -> None:
        print(f"    {record.name}: {record.configurations} configurations, "
              f"{record.default_s / record.best_s:.2f}x the heuristic choice "
              f"({record.best}), {record.seconds:.1f} s", flush=True)

    tune.on_record = report if args.verbose else None
    try:
        for i, target in enumerate(work):
            if tune.deadline is not None and time.monotonic() > tune.deadline:
                print(f"time limit reached: {len(work) - i} target(s) left untuned")
                break
            first, before = len(tune.records), tune.reused
            t0 = time.monotonic()
            target.run()
            device.synchronize()
            new = tune.records[first:]
            gain = max((r.default_s / r.best_s for r in new), default=1.0)
            bar = "#" * (20 * (i + 1) // len(work))
            print(f"[{bar:20s}] {i + 1:3d}/{len(work)} {target.label:28s} {len(new):2d} kernels "
                  f"tuned ({tune.reused - before} before), best gain {gain:4.2f}x, "
                  f"{time.monotonic() - t0:6.1f} s", flush=True)
            done += 1
    finally:
        tune.on_record = tune.deadline = tune.forced = None
    records = tune.records
    faster = [r for r in records if r.best_s < r.default_s]
    print(f"tuned {len(records)} kernels of {done} target(s) in {time.monotonic() - start:.1f} s; "
          f"{len(faster)} run faster than the heuristic choice")
    return 0


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
    p = sub.add_parser("tune", help="pre-tune the GEMM and convolution kernels of a model",
                       description="Time the template configurations of each product and "
                       "convolution kernel the targets run and keep the fastest on disk. "
                       "Targets: matmul:MxKxN, conv:CIN,COUT,K,STRIDE,SIZE (padding K//2), "
                       "resnet50 (its distinct convolutions), or a Python script.")
    p.add_argument("targets", nargs="+", help="what to tune (see above)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=["fp32", "tf32", "fp16", "bf16"], default="fp32")
    p.add_argument("--batch", type=int, default=16, help="batch of the convolutions")
    p.add_argument("--level", type=int, choices=[1, 2], default=1,
                   help="1: a few tile shapes per kernel; 2: a wider search")
    p.add_argument("--time-limit", type=float, default=0,
                   help="seconds; after them kernels keep the heuristic choice (0: none)")
    p.add_argument("-v", "--verbose", action="store_true", help="a line per kernel tuned")
    p.set_defaults(func=cmd_tune)
    bench.add_parser(sub)
    run_cmd.add_parser(sub)
    llm_cmd.add_parsers(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
