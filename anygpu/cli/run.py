"""``anygpu run model.onnx``: load an ONNX model on a device, feed it (NumPy files or random
data of the declared types and shapes), print its outputs, time repeated calls, and compare
with ONNX Runtime.

    anygpu run model.onnx --device cuda --input image=cat.npy --bench 100 --compare ort
    anygpu run encoder.onnx --dim seq=128 --dim batch=4 --save out.npz

``--bench N`` times N calls after warm-up (the first call, which compiles, is reported on its
own line) and prints the latency percentiles p50, p90 and p99. A call is what a user's call
costs: inputs from host arrays, outputs back as host arrays. ``--compare ort`` runs ONNX
Runtime (its CPU provider, or the providers given with ``--ort-providers``) on the same
inputs in the same process, prints the largest difference of each output and, with
``--bench``, ONNX Runtime's percentiles and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np

WARMUP = 3


def _parse_pairs(items: list[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"anygpu run: {what} must look like NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def _random_input(info: Any, dims: dict[str, int], rng: np.random.Generator) -> np.ndarray:
    """Data of an input's declared type; symbolic sizes from ``dims`` (default 1)."""
    if info.shape is None:
        raise SystemExit(f"anygpu run: input {info.name!r} has no declared shape; give it "
                         f"with --input {info.name}=file.npy")
    shape = []
    for d in info.shape:
        if isinstance(d, int):
            shape.append(d)
        elif d is not None and d in dims:
            shape.append(dims[d])
        else:
            shape.append(1)
    kind = info.dtype.kind
    if kind == "b":
        return rng.random(shape) < 0.5
    if kind in "iu":
        return rng.integers(0, 10, shape).astype(info.dtype)
    return rng.standard_normal(shape).astype(info.dtype)


def _timed(call: Callable[[], Any], n: int) -> list[float]:
    """Seconds of each of ``n`` calls after ``WARMUP`` untimed ones."""
    for _ in range(WARMUP):
        call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def _percentiles(times: list[float]) -> dict[str, float]:
    ms = np.asarray(times) * 1e3
    return {f"p{q}": float(np.percentile(ms, q)) for q in (50, 90, 99)}


def _print_latency(label: str, times: list[float]) -> dict[str, float]:
    p = _percentiles(times)
    print(f"{label}: p50 {p['p50']:.3f} ms  p90 {p['p90']:.3f} ms  p99 {p['p99']:.3f} ms "
          f"({len(times)} calls after {WARMUP} warm-up)")
    return p


def main(args: argparse.Namespace) -> int:
    import anygpu.onnx as agx

    if args.bench < 0:
        raise SystemExit(f"anygpu run: --bench takes a count of calls, got {args.bench}")
    model = agx.load(args.model, device=args.device, jit=not args.no_jit)
    print(model)
    files = _parse_pairs(args.input, "--input")
    try:
        dims = {k: int(v) for k, v in _parse_pairs(args.dim, "--dim").items()}
    except ValueError as bad:
        raise SystemExit(f"anygpu run: --dim sizes are integers ({bad})") from None
    rng = np.random.default_rng(args.seed)
    feed = {}
    for info in model.get_inputs():
        if info.name in files:
            feed[info.name] = np.load(files[info.name])
        else:
            feed[info.name] = _random_input(info, dims, rng)
    unknown = sorted(set(files) - set(feed))
    if unknown:
        raise SystemExit(f"anygpu run: the model has no input {unknown[0]!r}")
    for name, value in feed.items():
        print(f"input {name}: {value.dtype} {tuple(value.shape)}"
              f"{'' if name in files else ' (random)'}")
    start = time.perf_counter()
    outputs: list[np.ndarray] = model.run(None, feed)
    first = time.perf_counter() - start
    for name, value in zip(model.output_names, outputs):
        print(f"output {name}: {value.dtype} {tuple(value.shape)}{_summary(value)}")
    print(f"first call {first * 1e3:.1f} ms (compiling included)")
    mine = None
    if args.bench:
        mine = _print_latency(f"anygpu {args.device}", _timed(lambda: model.run(None, feed),
                                                               args.bench))
    if args.save:
        save: Any = np.savez  # (NumPy's stub types the keyword arrays as its flags)
        save(args.save, **dict(zip(model.output_names, outputs)))
        print(f"outputs written to {args.save}")
    if args.compare:
        return _compare_ort(args, feed, model.output_names, outputs, mine)
    return 0


def _summary(value: np.ndarray) -> str:
    if not value.size or value.dtype.kind not in "biuf":
        return ""
    v = value.astype(np.float64)
    return f" min {v.min():.4g} max {v.max():.4g} mean {v.mean():.4g}"


def _compare_ort(args: argparse.Namespace, feed: dict[str, np.ndarray], names: list[str],
                 outputs: list[np.ndarray], mine: dict[str, float] | None) -> int:
    try:
        import onnxruntime as ort
    except ImportError as missing:
        raise SystemExit("anygpu run --compare ort needs onnxruntime (pip install onnxruntime)"
                         ) from missing
    providers = args.ort_providers.split(",")
    absent = [p for p in providers if p not in ort.get_available_providers()]
    if absent:
        raise SystemExit(f"anygpu run: ONNX Runtime here has no {absent[0]} (it has "
                         f"{', '.join(ort.get_available_providers())})")
    session = ort.InferenceSession(args.model, providers=providers)
    want = session.run(None, feed)
    ok = True
    for name, got, ref in zip(names, outputs, want):
        if got.shape != ref.shape:
            print(f"{name}: shape {got.shape}, ONNX Runtime {ref.shape}")
            ok = False
            continue
        g, r = got.astype(np.float64), ref.astype(np.float64)
        diff = np.abs(g - r)
        err = float(np.nanmax(diff)) if diff.size and not np.isnan(diff).all() else 0.0
        close = np.allclose(g, r, rtol=args.rtol, atol=args.atol, equal_nan=True)
        ok &= bool(close)
        print(f"{name}: largest |difference| from ONNX Runtime {err:.3g}"
              f"{'' if close else f'  (beyond rtol {args.rtol:g}, atol {args.atol:g})'}")
    if mine is not None:
        theirs = _print_latency(f"ONNX Runtime {','.join(providers)}",
                                _timed(lambda: session.run(None, feed), args.bench))
        print(f"anygpu / ONNX Runtime (p50): {mine['p50'] / theirs['p50']:.2f}x")
    return 0 if ok else 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="run an ONNX model on a device",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="path of the .onnx file")
    p.add_argument("--device", default="cpu", help='e.g. "cpu", "cuda", "opencl", "webgpu"')
    p.add_argument("--input", action="append", metavar="NAME=FILE.npy",
                   help="an input's data (others get random data of their declared type)")
    p.add_argument("--dim", action="append", metavar="NAME=SIZE",
                   help="the size of a symbolic dimension for random inputs (default 1)")
    p.add_argument("--bench", type=int, default=0, metavar="N",
                   help="time N calls after warm-up and print latency percentiles")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--save", metavar="OUT.npz", help="write the outputs to a NumPy archive")
    p.add_argument("--compare", choices=["ort"], help="compare with ONNX Runtime")
    p.add_argument("--ort-providers", default="CPUExecutionProvider",
                   help="ONNX Runtime's execution providers for --compare, comma-separated")
    p.add_argument("--rtol", type=float, default=1e-3, help="tolerance of --compare")
    p.add_argument("--atol", type=float, default=1e-4, help="tolerance of --compare")
    p.add_argument("--no-jit", action="store_true", help="never replay captured launches")
    p.set_defaults(func=main)
