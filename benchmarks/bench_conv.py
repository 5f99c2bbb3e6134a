"""Every distinct convolution of ResNet-50 (batch 16, 224 x 224 input) against PyTorch (cuDNN) on
the same GPU, in one run: forward, and backward (the gradients of input and weight together).
With ``--device cpu`` the peer is PyTorch on the processor.

    python benchmarks/bench_conv.py --device cuda [--batch 16] [--tf32] [--only N ...]
        [--winograd auto|on|off] [--json out.json]

Times are the kernels anygpu launches for each (queued back to back, median of several rounds,
inputs realized first), beside ``torch.nn.functional.conv2d`` and ``torch.autograd.grad`` timed
the same way; exact float32 on both sides unless ``--tf32``. The result is checked against
PyTorch's first. The table ends with the geometric mean of the time ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anygpu as ag  # noqa: E402
from anygpu.graph import schedule as sched  # noqa: E402
from anygpu.nn import functional as F  # noqa: E402
from anygpu.runtime.registry import get_device  # noqa: E402
from anygpu.tune.targets import RESNET50  # noqa: E402
from peaks import peak_tflops  # noqa: E402  (benchmarks/peaks.py)
from timing import median_time  # noqa: E402  (benchmarks/timing.py)

def _launches(outputs: list[ag.Tensor]) -> list[Any]:
    """The launches that compute ``outputs``, recorded while they run once (each kernel reads
    what the ones before it wrote)."""
    sched.recording = []
    try:
        sched.run(sched.schedule([t.lazy for t in outputs]))
        return [step for step in sched.recording if isinstance(step, sched.Launch)]
    finally:
        sched.recording = None


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))


def _measure(device: str, batch: int, reps: int, shape: tuple[int, int, int, int, int],
             rng: np.random.Generator, tdev: str, tsync: Callable[[], None]) -> dict:
    """One convolution: anygpu's forward and backward kernels beside PyTorch's."""
    import torch

    cin, cout, k, stride, size = shape
    dev = get_device(device)
    pad = k // 2
    x_h = rng.standard_normal((batch, cin, size, size), dtype=np.float32)
    w_h = (rng.standard_normal((cout, cin, k, k), dtype=np.float32) / math.sqrt(cin * k * k))
    out_size = (size + 2 * pad - k) // stride + 1
    g_h = rng.standard_normal((batch, cout, out_size, out_size), dtype=np.float32)
    x = ag.tensor(x_h, device=device).realize()
    w = ag.tensor(w_h, device=device).realize()
    g = ag.tensor(g_h, device=device).realize()
    tx = torch.from_numpy(x_h).to(tdev).requires_grad_()
    tw = torch.from_numpy(w_h).to(tdev).requires_grad_()
    tg = torch.from_numpy(g_h).to(tdev)

    out = F.conv2d(x, w, stride=stride, padding=pad)
    fwd = _launches([out])
    t_fwd = median_time(lambda: [launch() for launch in fwd], dev.synchronize, reps, rounds=3)
    ref = torch.nn.functional.conv2d(tx, tw, stride=stride, padding=pad)
    err_fwd = _rel_err(out.numpy(), ref.detach().cpu().numpy())

    xg = ag.tensor(x_h, device=device, requires_grad=True)
    wg = ag.tensor(w_h, device=device, requires_grad=True)
    (F.conv2d(xg, wg, stride=stride, padding=pad) * g).sum().backward()
    assert xg.grad is not None and wg.grad is not None
    bwd = _launches([xg.grad, wg.grad])
    t_bwd = median_time(lambda: [launch() for launch in bwd], dev.synchronize, reps, rounds=3)
    gx, gw = torch.autograd.grad(ref, (tx, tw), tg, retain_graph=True)
    err_bwd = max(_rel_err(xg.grad.numpy(), gx.cpu().numpy()),
                  _rel_err(wg.grad.numpy(), gw.cpu().numpy()))

    def torch_fwd() -> Any:
        return torch.nn.functional.conv2d(tx, tw, stride=stride, padding=pad)

    def torch_bwd() -> Any:
        return torch.autograd.grad(ref, (tx, tw), tg, retain_graph=True)

    tt_fwd = median_time(torch_fwd, tsync, reps, rounds=3)
    tt_bwd = median_time(torch_bwd, tsync, reps, rounds=3)
    flops = 2.0 * batch * out_size * out_size * cout * cin * k * k  # backward: twice that
    row = {"conv": f"{cin}->{cout} {k}x{k} s{stride} @{size}", "fwd_gflop": flops / 1e9,
           "fwd_ms": t_fwd * 1e3,
           "torch_fwd_ms": tt_fwd * 1e3, "bwd_ms": t_bwd * 1e3, "torch_bwd_ms": tt_bwd * 1e3,
           "fwd_kernels": len(fwd), "bwd_kernels": len(bwd), "err_fwd": err_fwd,
           "err_bwd": err_bwd}
    print(f"{row['conv']:26s} fwd {row['fwd_ms']:8.3f} ms ({len(fwd)} kernels) vs "
          f"{row['torch_fwd_ms']:7.3f} = {t_fwd / tt_fwd:5.2f}x | bwd {row['bwd_ms']:8.3f} ms "
          f"({len(bwd)} kernels) vs {row['torch_bwd_ms']:7.3f} = {t_bwd / tt_bwd:5.2f}x | "
          f"err {err_fwd:.1e} {err_bwd:.1e}", flush=True)
    return row


def run(device: str, batch: int, reps: int, tf32: bool, only: list[int] | None) -> list[dict]:
    import torch

    # the peer: PyTorch on the same GPU, or on the processor for the cpu backend
    on_gpu = torch.cuda.is_available() and get_device(device).backend != "cpu"
    tdev = "cuda" if on_gpu else "cpu"
    tsync = torch.cuda.synchronize if on_gpu else (lambda: None)
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    ag.set_float32_matmul_precision("high" if tf32 else "highest")
    rows = []
    rng = np.random.default_rng(0)
    for index, shape in enumerate(RESNET50):
        if only is not None and index not in only:
            continue
        rows.append(_measure(device, batch, reps, shape, rng, tdev, tsync))
    if rows:
        for key in ("fwd", "bwd"):
            ratios = [r[f"{key}_ms"] / r[f"torch_{key}_ms"] for r in rows]
            geo = math.exp(sum(math.log(v) for v in ratios) / len(ratios))
            work = sum(r["fwd_gflop"] for r in rows) * (1 if key == "fwd" else 2) / 1e3
            ours = work / sum(r[f"{key}_ms"] for r in rows) * 1e3
            theirs = work / sum(r[f"torch_{key}_ms"] for r in rows) * 1e3
            peak = peak_tflops("tf32" if tf32 else "float32") if on_gpu else None
            rate = f"; {ours:.1f} TFLOP/s over all, PyTorch {theirs:.1f}"
            if peak:
                rate += (f" (peak {peak:.0f}: {100 * ours / peak:.0f}% and "
                         f"{100 * theirs / peak:.0f}%)")
            print(f"{key}: geometric mean {geo:.2f}x PyTorch's time, worst {max(ratios):.2f}x"
                  + rate)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tf32", action="store_true")
    parser.add_argument("--only", type=int, nargs="+",
                        help="run only the convolutions at these indices")
    parser.add_argument("--winograd", choices=["auto", "on", "off"], default="auto",
                        help="3x3 stride-1 convolutions by Winograd's F(2x2, 3x3): where it wins, "
                             "always or never")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    F.WINOGRAD = {"auto": None, "on": True, "off": False}[args.winograd]
    rows = run(args.device, args.batch, args.reps, args.tf32, args.only)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
