"""Memory-bound kernels against the device's own copy bandwidth, and against PyTorch or NumPy.

    python benchmarks/bench_core.py --device cuda opencl webgpu cpu [--json out.json]

For each device: the device-to-device copy bandwidth (bytes read + written per second), then
  fused chain   ((x * 1.5 + 0.25).relu() - 0.5) over 256 MiB of float32 (one kernel)
  row sum       x.sum(1) of an 8192 x 8192 float32 matrix
  softmax       x.softmax(-1) over the rows of the same matrix
each as the kernel's time (launches queued back to back, median of several rounds) and as GB/s of
the fewest bytes it must move, with the same ops in PyTorch on the same GPU (cuda) or in NumPy
(cpu) timed the same way in the same run. On the cpu the sizes are a quarter (64 MiB).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anygpu as ag  # noqa: E402
from anygpu.graph.schedule import KernelItem, prepare, schedule  # noqa: E402
from anygpu.runtime.base import Device  # noqa: E402
from anygpu.runtime.registry import get_device  # noqa: E402
from timing import median_time  # noqa: E402  (benchmarks/timing.py)


def _kernel_time(t: ag.Tensor, reps: int) -> tuple[float, str]:
    """Time the single kernel that computes ``t`` (inputs already realized)."""
    items = schedule([t.lazy])
    kernels = [i for i in items if isinstance(i, KernelItem)]
    if len(kernels) != 1:
        raise RuntimeError(f"expected one kernel, the schedule has {len(kernels)}")
    launch = prepare(kernels[0])
    dev = get_device(t.device)
    return median_time(launch, dev.synchronize, reps), launch.name


def _check(t: ag.Tensor, ref: np.ndarray, rtol: float) -> None:
    out = t.numpy()
    err = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)
    if not err < rtol:
        raise AssertionError(f"wrong result: relative error {err:.3g}")


def _copy_time(dev: Device, host: np.ndarray, reps: int) -> float:
    """Seconds per device-to-device copy of ``host``; the two buffers are freed on return."""
    src, dst = dev.alloc(host.nbytes), dev.alloc(host.nbytes)
    src.copy_in(host)
    return median_time(lambda: dev.copy(dst, src), dev.synchronize, reps)


def bench_device(name: str, reps: int) -> dict[str, Any]:
    dev = get_device(name)
    cpu = dev.backend == "cpu"
    rows, cols = (4096, 4096) if cpu else (8192, 8192)
    n = rows * cols  # 64 MiB (cpu) or 256 MiB of float32
    nbytes = n * 4
    result: dict[str, Any] = {"device": dev.name, "name": dev.info.name, "driver": dev.info.driver,
                              "bytes": nbytes}
    rng = np.random.default_rng(0)
    host = rng.standard_normal(n, dtype=np.float32)

    copy_s = _copy_time(dev, host, reps)
    copy_bw = 2 * nbytes / copy_s
    result["copy_GBps"] = copy_bw / 1e9

    x = ag.tensor(host, device=name).realize()
    xm = x.reshape(rows, cols)
    cases = {
        "fused chain": (((x * 1.5 + 0.25).relu() - 0.5), 2 * nbytes,
                        lambda a: np.maximum(a * 1.5 + 0.25, 0) - 0.5, host),
        "row sum": (xm.sum(1), nbytes + rows * 4, lambda a: a.sum(1), host.reshape(rows, cols)),
        "softmax": (xm.softmax(-1), 2 * nbytes,
                    lambda a: (lambda e: e / e.sum(1, keepdims=True))(
                        np.exp(a - a.max(1, keepdims=True))), host.reshape(rows, cols)),
    }
    peer = _torch_peer(name, host, rows, cols, reps) if dev.backend == "cuda" else {}
    for label, (t, moved, np_fn, arr) in cases.items():
        seconds, kernel = _kernel_time(t, reps)
        _check(t, np_fn(arr.astype(np.float64)).astype(np.float32), 1e-4)
        entry = {"kernel": kernel, "ms": seconds * 1e3, "GBps": moved / seconds / 1e9,
                 "of_copy": moved / seconds / copy_bw}
        if cpu:
            np_s = median_time(functools.partial(np_fn, arr), lambda: None, max(reps // 4, 2),
                                rounds=3)
            entry["numpy_ms"] = np_s * 1e3
        if label in peer:
            entry["torch_ms"] = peer[label] * 1e3
        result[label] = entry
    return result


def _torch_peer(name: str, host: np.ndarray, rows: int, cols: int, reps: int) -> dict[str, float]:
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    x = torch.from_numpy(host).cuda()
    xm = x.reshape(rows, cols)
    sync = torch.cuda.synchronize
    return {
        "fused chain": median_time(lambda: (x * 1.5 + 0.25).relu() - 0.5, sync, reps),
        "row sum": median_time(lambda: xm.sum(1), sync, reps),
        "softmax": median_time(lambda: xm.softmax(-1), sync, reps),
    }


GOALS = {"fused chain": 0.85, "row sum": 0.80, "softmax": 0.70}


def print_table(results: list[dict[str, Any]]) -> None:
    for r in results:
        print(f"\n{r['device']}  {r['name']}")
        print(f"  device-to-device copy: {r['copy_GBps']:.0f} GB/s (read + write)")
        print(f"  {'kernel':12s} {'ms':>8s} {'GB/s':>8s} {'% copy':>7s} {'goal':>5s} "
              f"{'peer ms':>9s}  peer")
        for label in GOALS:
            e = r.get(label)
            if e is None:
                continue
            goal = "" if r["device"].startswith("cpu") else f"{GOALS[label]:.0%}"
            if "torch_ms" in e:
                peer, who = f"{e['torch_ms']:9.3f}", "PyTorch (same GPU)"
            elif "numpy_ms" in e:
                peer, who = f"{e['numpy_ms']:9.3f}", "NumPy"
            else:
                peer, who = f"{'':9s}", ""
            print(f"  {label:12s} {e['ms']:8.3f} {e['GBps']:8.0f} {e['of_copy']:7.0%} {goal:>5s} "
                  f"{peer}  {who}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", nargs="+", default=["cpu"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    results = []
    for name in args.device:
        try:
            results.append(bench_device(name, args.reps))
        except (ag.BackendUnavailable, ag.DeviceError) as err:
            print(f"{name}: not measured: {err}")
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
