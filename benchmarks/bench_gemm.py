"""Matrix products against PyTorch on the same GPU, in one run.

    python benchmarks/bench_gemm.py --device cuda opencl webgpu [--size 4096] [--json out.json]

For each device and dtype: C = A @ B with square operands of ``--size`` (4096 by default), timed
as the one kernel anygpu launches for it (launches queued back to back, median of several rounds),
in TFLOP/s (2 * M * N * K per product), beside ``torch.matmul`` on the same GPU timed the same
way (PyTorch on the processor for ``--device cpu``): float32 exact on both sides, tf32 (CUDA)
with ``set_float32_matmul_precision("high")`` here and ``allow_tf32`` there, float16 and
bfloat16. The result is checked against PyTorch's first. Also transposed operands (A.T @ B,
and A @ B.T: a linear layer's product, both operands along k) and a fused epilogue
((A @ B + bias).relu()), each one kernel. Each row ends with the GPU's peak rate for the
precision (``benchmarks/peaks.py``) and the share of it both sides reach.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anygpu as ag  # noqa: E402
from anygpu.graph.schedule import KernelItem, prepare, schedule  # noqa: E402
from anygpu.runtime.registry import get_device  # noqa: E402
from peaks import peak_tflops  # noqa: E402  (benchmarks/peaks.py)
from timing import median_time  # noqa: E402  (benchmarks/timing.py)


def _kernel(t: ag.Tensor) -> Any:
    items = [i for i in schedule([t.lazy]) if isinstance(i, KernelItem)]
    if len(items) != 1:
        raise RuntimeError(f"expected one kernel, the schedule has {len(items)}")
    return prepare(items[0])


def _cases(a: Any, b: Any, bias: Any) -> dict[str, Callable[[], Any]]:
    """The products timed, for anygpu and torch tensors alike."""
    return {"A @ B": lambda: a @ b, "A.T @ B": lambda: a.T @ b, "A @ B.T": lambda: a @ b.T,
            "(A @ B + bias).relu()": lambda: (a @ b + bias).relu()}


def _torch_time(fn: Callable[[], Any], reps: int, on_gpu: bool) -> float:
    import torch

    return median_time(fn, torch.cuda.synchronize if on_gpu else (lambda: None), reps)


def run(devices: list[str], size: int, reps: int) -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    n = size
    a_host = rng.standard_normal((n, n), dtype=np.float32)
    b_host = rng.standard_normal((n, n), dtype=np.float32)
    bias_host = rng.standard_normal((n,), dtype=np.float32)
    flops = 2.0 * n * n * n
    try:
        import torch
        torch.backends.cuda.matmul.allow_tf32 = False
        torch_found, cuda_torch = True, torch.cuda.is_available()
    except ImportError:
        torch_found, cuda_torch = False, False
    for device in devices:
        # the peer: PyTorch on the same GPU, or on the processor for the cpu backend
        dev = get_device(device)
        on_cpu = dev.backend == "cpu"
        have_torch = torch_found and (cuda_torch or on_cpu)
        tdev = "cpu" if on_cpu else "cuda"
        for precision in ("float32", "tf32", "float16", "bfloat16"):
            dtype = ag.float32 if precision == "tf32" else getattr(ag, precision)
            if not dev.supports(dtype) or (precision == "tf32" and dev.dialect != "cuda"):
                continue  # tf32 is a CUDA tensor-core mode
            ag.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
            if have_torch:
                torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
            a = ag.tensor(a_host, device=device).cast(dtype).realize()
            b = ag.tensor(b_host, device=device).cast(dtype).realize()
            bias = ag.tensor(bias_host, device=device).cast(dtype).realize()
            for label, build in _cases(a, b, bias).items():
                out = build()
                launch = _kernel(out)
                name = launch.name
                seconds = median_time(launch, dev.synchronize, reps)
                out.realize()
                row: dict[str, Any] = {"device": device, "dtype": precision, "case": label,
                                       "n": n, "kernel": name, "ms": seconds * 1e3,
                                       "tflops": flops / seconds / 1e12}
                if have_torch:
                    tdt = {"float32": torch.float32, "float16": torch.float16,
                           "bfloat16": torch.bfloat16}[dtype.name]
                    ta = torch.from_numpy(a_host).to(tdev).to(tdt)
                    tb = torch.from_numpy(b_host).to(tdev).to(tdt)
                    tbias = torch.from_numpy(bias_host).to(tdev).to(tdt)
                    tcases = _cases(ta, tb, tbias)
                    ref = tcases[label]().float().cpu().numpy()
                    got = out.float().numpy()
                    err = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30))
                    ts = _torch_time(tcases[label], reps, not on_cpu)
                    row.update(torch_ms=ts * 1e3 if ts else None,
                               torch_tflops=flops / ts / 1e12 if ts else None,
                               ratio=(ts / seconds) if ts else None, max_rel_err=err)
                peak = None if on_cpu else peak_tflops(precision)
                row["peak_tflops"] = peak
                rows.append(row)
                line = (f"{device:8s} {precision:9s} {label:24s} {row['ms']:8.3f} ms "
                        f"{row['tflops']:7.2f} TFLOP/s")
                if row.get("torch_ms"):
                    line += (f" | torch {row['torch_ms']:8.3f} ms {row['torch_tflops']:7.2f} "
                             f"TFLOP/s | {100 * row['ratio']:5.1f}% of torch | "
                             f"err {row['max_rel_err']:.1e}")
                if peak:
                    line += f" | peak {peak:6.1f}: {100 * row['tflops'] / peak:4.1f}%"
                    if row.get("torch_tflops"):
                        line += f", torch {100 * row['torch_tflops'] / peak:4.1f}%"
                print(line + f"  [{name}]", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", nargs="+", default=["cuda"])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    devices = []
    for d in args.device:
        try:
            get_device(d)
            devices.append(d)
        except Exception as err:  # a device this machine lacks is reported, not fatal
            print(f"{d}: unavailable ({err})")
    rows = run(devices, args.size, args.reps)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
