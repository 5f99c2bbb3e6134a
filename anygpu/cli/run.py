"""``anygpu run model.onnx``: load an ONNX model on a device, feed it (NumPy files or random
data of the declared types and shapes), print its outputs, time repeated calls, and compare
with ONNX Runtime.

    anygpu run model.onnx --device cuda --input image=cat.npy --repeat 20 --check
    anygpu run encoder.onnx --dim seq=128 --dim batch=4 --save out.npz
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np


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


def main(args: argparse.Namespace) -> int:
    import anygpu.onnx as agx

    model = agx.load(args.model, device=args.device, jit=not args.no_jit)
    print(model)
    files = _parse_pairs(args.input, "--input")
    dims = {k: int(v) for k, v in _parse_pairs(args.dim, "--dim").items()}
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
    times = []
    outputs: list[np.ndarray] = []
    for _ in range(max(args.repeat, 1)):
        start = time.perf_counter()
        outputs = model.run(None, feed)
        times.append(time.perf_counter() - start)
    for name, value in zip(model.output_names, outputs):
        summary = ""
        if value.size and value.dtype.kind in "biuf":
            v = value.astype(np.float64)
            summary = f" min {v.min():.4g} max {v.max():.4g} mean {v.mean():.4g}"
        print(f"{name}: {value.dtype} {tuple(value.shape)}{summary}")
    print(f"first call {times[0] * 1e3:.1f} ms (includes compiling)", end="")
    if len(times) > 1:
        print(f", then {np.median(times[1:]) * 1e3:.2f} ms per call (median of "
              f"{len(times) - 1})")
    else:
        print()
    if args.save:
        save: Any = np.savez  # (NumPy's stub types the keyword arrays as its flags)
        save(args.save, **dict(zip(model.output_names, outputs)))
        print(f"outputs written to {args.save}")
    if args.check:
        return _check(args.model, feed, model.output_names, outputs)
    return 0


def _check(path: str, feed: dict[str, np.ndarray], names: list[str],
           outputs: list[np.ndarray]) -> int:
    try:
        import onnxruntime as ort
    except ImportError as missing:
        raise SystemExit("anygpu run --check needs onnxruntime (pip install onnxruntime)"
                         ) from missing
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    want = session.run(None, feed)
    worst = 0.0
    ok = True
    for name, got, ref in zip(names, outputs, want):
        if got.shape != ref.shape:
            print(f"{name}: shape {got.shape}, ONNX Runtime {ref.shape}")
            ok = False
            continue
        diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
        err = float(diff.max()) if diff.size else 0.0
        worst = max(worst, err)
        close = np.allclose(got.astype(np.float64), ref.astype(np.float64), rtol=1e-3,
                            atol=1e-4, equal_nan=True)
        ok &= bool(close)
        print(f"{name}: max |difference| from ONNX Runtime {err:.3g}"
              f"{'' if close else '  (beyond rtol 1e-3, atol 1e-4)'}")
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
    p.add_argument("--repeat", type=int, default=1, help="calls to time")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--save", metavar="OUT.npz", help="write the outputs to a NumPy archive")
    p.add_argument("--check", action="store_true", help="compare with ONNX Runtime")
    p.add_argument("--no-jit", action="store_true", help="never replay captured launches")
    p.set_defaults(func=main)
