"""What ``anygpu tune`` can pre-tune: products and convolutions given by their shapes, every
distinct convolution of a ResNet-50, or a Python script (a model's training step), each run
once with tuning on so that its kernels' winners land on disk.

    matmul:MxKxN               a product (m x k) @ (k x n), forward and both gradients
    conv:CIN,COUT,K,STRIDE,SIZE a K x K convolution (padding K // 2) of a SIZE x SIZE input
                               at the batch given, forward and both gradients
    resnet50                   every distinct convolution of ResNet-50 (v1.5) at that batch
    path/to/script.py          run as ``python script.py`` would, tuning each kernel it runs
"""

from __future__ import annotations

import math
import runpy
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

from anygpu.dtype import DType

# (in channels, out channels, kernel, stride, input size): torchvision's ResNet-50 (v1.5)
RESNET50 = [
    (3, 64, 7, 2, 224),
    (64, 64, 1, 1, 56), (64, 64, 3, 1, 56), (64, 256, 1, 1, 56), (256, 64, 1, 1, 56),
    (256, 128, 1, 1, 56), (128, 128, 3, 2, 56), (128, 512, 1, 1, 28), (256, 512, 1, 2, 56),
    (512, 128, 1, 1, 28), (128, 128, 3, 1, 28),
    (512, 256, 1, 1, 28), (256, 256, 3, 2, 28), (256, 1024, 1, 1, 14), (512, 1024, 1, 2, 28),
    (1024, 256, 1, 1, 14), (256, 256, 3, 1, 14),
    (1024, 512, 1, 1, 14), (512, 512, 3, 2, 14), (512, 2048, 1, 1, 7), (1024, 2048, 1, 2, 14),
    (2048, 512, 1, 1, 7), (512, 512, 3, 1, 7),
]


@dataclass
class Target:
    label: str
    run: Callable[[], None]


def _ints(text: str, sep: str, count: int, spec: str) -> list[int]:
    parts = text.split(sep)
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != count or min(values) < 1:
        raise ValueError(f"{spec!r}: expected {count} positive integers separated by {sep!r}")
    return values


def _random(shape: tuple[int, ...], scale: float, device: str, dtype: DType):
    import anygpu as ag

    host = np.random.default_rng().standard_normal(shape, dtype=np.float32) * scale
    return ag.tensor(host, device=device, dtype=dtype, requires_grad=True)


def matmul(m: int, k: int, n: int, device: str, dtype: DType) -> Target:
    def run() -> None:
        a = _random((m, k), 1.0, device, dtype)
        b = _random((k, n), 1 / math.sqrt(k), device, dtype)
        out = (a @ b).realize()
        (out * _random(out.shape, 1.0, device, dtype).detach()).sum().backward()
        assert a.grad is not None and b.grad is not None
        a.grad.realize(), b.grad.realize()

    return Target(f"matmul {m}x{k}x{n}", run)


def conv(cin: int, cout: int, k: int, stride: int, size: int, batch: int, device: str,
         dtype: DType) -> Target:
    def run() -> None:
        from anygpu.nn import functional as F

        x = _random((batch, cin, size, size), 1.0, device, dtype)
        w = _random((cout, cin, k, k), 1 / math.sqrt(cin * k * k), device, dtype)
        out = F.conv2d(x, w, stride=stride, padding=k // 2).realize()
        (out * _random(out.shape, 1.0, device, dtype).detach()).sum().backward()
        assert x.grad is not None and w.grad is not None
        x.grad.realize(), w.grad.realize()

    return Target(f"conv {cin}->{cout} {k}x{k} s{stride} @{size}", run)


def script(path: str) -> Target:
    def run() -> None:
        argv = sys.argv
        sys.argv = [path]
        try:
            runpy.run_path(path, run_name="__main__")
        finally:
            sys.argv = argv

    return Target(path, run)


def parse(spec: str, batch: int, device: str, dtype: DType) -> list[Target]:
    """The targets one command-line argument names (see the module's docstring)."""
    if spec == "resnet50":
        return [conv(*shape, batch=batch, device=device, dtype=dtype) for shape in RESNET50]
    if spec.startswith("matmul:"):
        m, k, n = _ints(spec[7:], "x", 3, spec)
        return [matmul(m, k, n, device, dtype)]
    if spec.startswith("conv:"):
        cin, cout, k, stride, size = _ints(spec[5:], ",", 5, spec)
        return [conv(cin, cout, k, stride, size, batch, device, dtype)]
    if spec.endswith(".py"):
        import os

        if not os.path.isfile(spec):
            raise ValueError(f"{spec!r}: no such file")
        return [script(spec)]
    raise ValueError(f"{spec!r}: not a target (matmul:MxKxN, conv:CIN,COUT,K,STRIDE,SIZE, "
                     "resnet50, or a .py file)")
