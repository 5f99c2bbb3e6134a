"""Normalization, pooling and the softmax family against PyTorch on the same GPU, in one run:
forward, and forward with backward, at ResNet-50 and transformer sizes.

    python benchmarks/bench_norm.py --device cuda [--json out.json]

Each op is timed as the kernels anygpu launches for it (recorded once, then queued back to back,
median of several rounds, inputs realized first) beside PyTorch's eager call timed the same way,
with the number of kernels and the bytes they must move at the least (inputs read once, outputs
written once) as GB/s. Results are checked against PyTorch's first.
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
from anygpu.graph import schedule as sched  # noqa: E402
from anygpu.nn import functional as F  # noqa: E402
from anygpu.runtime.registry import get_device  # noqa: E402
from timing import median_time  # noqa: E402  (benchmarks/timing.py)


def _launches(outputs: list[ag.Tensor]) -> list[Any]:
    sched.recording = []
    try:
        sched.run(sched.schedule([t.lazy for t in outputs]))
        return [s for s in sched.recording if isinstance(s, sched.Launch)]
    finally:
        sched.recording = None


def _cases(batch: int) -> list[tuple[str, tuple[int, ...], Callable, Callable, int]]:
    """(label, input shape, anygpu op, torch op, tensors the op reads and writes, in units of
    the input's size) for each op."""
    import torch

    tf = torch.nn.functional
    c1, c2 = 64, 256

    def bn(f: Any) -> Callable:
        def run(x: Any, params: dict) -> Any:
            return f.batch_norm(x, params["rm"], params["rv"], params["w"], params["b"], True,
                                0.1, 1e-5)
        return run

    def pool(f: Any) -> Callable:
        return lambda x, params: f.max_pool2d(x, 3, 2, 1)

    return [
        (f"batch_norm {batch}x64x112x112", (batch, c1, 112, 112), bn(F), bn(tf), 2),
        (f"batch_norm {batch}x256x56x56", (batch, c2, 56, 56), bn(F), bn(tf), 2),
        ("layer_norm 8192x1024", (8192, 1024),
         lambda x, p: F.layer_norm(x, (1024,), p["lw"], p["lb"]),
         lambda x, p: tf.layer_norm(x, (1024,), p["lw"], p["lb"]), 2),
        (f"max_pool2d 3x3 s2 {batch}x64x112x112", (batch, c1, 112, 112), pool(F), pool(tf), 1),
        (f"avg_pool2d 2x2 {batch}x256x56x56", (batch, c2, 56, 56),
         lambda x, p: F.avg_pool2d(x, 2), lambda x, p: tf.avg_pool2d(x, 2), 1),
        ("softmax 8192x1024", (8192, 1024), lambda x, p: F.softmax(x, -1),
         lambda x, p: tf.softmax(x, -1), 2),
        ("log_softmax 8192x1024", (8192, 1024), lambda x, p: F.log_softmax(x, -1),
         lambda x, p: tf.log_softmax(x, -1), 2),
        ("cross_entropy 8192x1024", (8192, 1024),
         lambda x, p: F.cross_entropy(x, p["target"]),
         lambda x, p: tf.cross_entropy(x, p["target"]), 1),
    ]


def _params(rng: np.random.Generator, shape: tuple[int, ...], device: str | None,
            tdev: str | None) -> dict:
    import torch

    c = shape[1]
    host = {"rm": rng.standard_normal(c), "rv": rng.uniform(0.5, 2, c),
            "w": rng.standard_normal(c), "b": rng.standard_normal(c),
            "lw": rng.standard_normal(shape[-1]), "lb": rng.standard_normal(shape[-1])}
    host = {k: v.astype(np.float32) for k, v in host.items()}
    target = rng.integers(0, shape[-1], shape[0])
    if device is not None:
        out: dict = {k: ag.tensor(v, device=device).realize() for k, v in host.items()}
        out["target"] = ag.tensor(target, device=device).realize()
        return out
    out = {k: torch.from_numpy(v).to(tdev) for k, v in host.items()}
    out["target"] = torch.from_numpy(target).to(tdev)
    return out


def _measure(device: str, tdev: str, tsync: Callable[[], None], rng: np.random.Generator,
             reps: int, case: tuple) -> dict:
    """One op: anygpu's kernels beside PyTorch's, forward and forward with backward."""
    import torch

    label, shape, ours, theirs, units = case
    dev = get_device(device)
    x_h = rng.standard_normal(shape, dtype=np.float32)
    nbytes = x_h.nbytes * units
    p = _params(rng, shape, device, None)
    tp = {k: torch.from_numpy(v.numpy()).to(tdev) for k, v in p.items()}  # the same values
    x = ag.tensor(x_h, device=device).realize()
    tx = torch.from_numpy(x_h).to(tdev)
    out = ours(x, p)
    fwd = _launches([out])
    t_fwd = median_time(lambda: [launch() for launch in fwd], dev.synchronize, reps)
    err = float(np.abs(out.numpy() - theirs(tx, tp).cpu().numpy()).max())
    tt_fwd = median_time(lambda: theirs(tx, tp), tsync, reps)

    xg = ag.tensor(x_h, device=device, requires_grad=True)
    g_h = rng.standard_normal(out.shape, dtype=np.float32)
    (ours(xg, p) * ag.tensor(g_h, device=device)).sum().backward()
    assert xg.grad is not None
    bwd = _launches([xg.grad])
    t_bwd = median_time(lambda: [launch() for launch in bwd], dev.synchronize, reps)
    txg = tx.clone().requires_grad_()
    tg = torch.from_numpy(g_h).to(tdev)

    def torch_both() -> Any:
        return torch.autograd.grad(theirs(txg, tp), (txg,), tg)

    (tgrad,) = torch_both()
    err_g = float(np.abs(xg.grad.numpy() - tgrad.cpu().numpy()).max())
    tt_bwd = median_time(torch_both, tsync, reps)
    row = {"op": label, "fwd_ms": t_fwd * 1e3, "torch_fwd_ms": tt_fwd * 1e3,
           "fwd_kernels": len(fwd), "fwd_gbs": nbytes / t_fwd / 1e9,
           "train_ms": t_bwd * 1e3, "torch_train_ms": tt_bwd * 1e3,
           "train_kernels": len(bwd), "err": err, "err_grad": err_g}
    print(f"{label:32s} fwd {row['fwd_ms']:7.3f} ms ({len(fwd)} kernels, "
          f"{row['fwd_gbs']:6.0f} GB/s) vs {row['torch_fwd_ms']:7.3f} = "
          f"{t_fwd / tt_fwd:5.2f}x | fwd+bwd {row['train_ms']:7.3f} ms ({len(bwd)} kernels) "
          f"vs {row['torch_train_ms']:7.3f} = {t_bwd / tt_bwd:5.2f}x | err {err:.1e} "
          f"{err_g:.1e}", flush=True)
    return row


def run(device: str, batch: int, reps: int) -> list[dict]:
    import torch

    on_gpu = torch.cuda.is_available() and get_device(device).backend != "cpu"
    tdev = "cuda" if on_gpu else "cpu"
    tsync = torch.cuda.synchronize if on_gpu else (lambda: None)
    rng = np.random.default_rng(0)
    return [_measure(device, tdev, tsync, rng, reps, case) for case in _cases(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = run(args.device, args.batch, args.reps)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
