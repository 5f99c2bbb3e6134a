"""Functional forms of the layers, with PyTorch's names and signatures.

>>> import anygpu as ag
>>> from anygpu.nn import functional as F
>>> x = ag.ones(1, 1, 4, 4)
>>> F.conv2d(x, ag.ones(1, 1, 3, 3), padding=1).shape
(1, 1, 4, 4)
"""

from __future__ import annotations

import math
from typing import Any, Sequence, Union

from anygpu import dtype as dt
from anygpu.tensor import Tensor, arange, cat, rand, where

IntPair = Union[int, Sequence[int]]


def _pair(v: IntPair, name: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    t = tuple(int(x) for x in v)
    if len(t) != 2:
        raise ValueError(f"{name} must be an int or a pair, got {v!r}")
    return t  # type: ignore[return-value]


def _pool1d(x: Tensor, k: int, s: int, d: int) -> Tensor:
    """Sliding windows over the last axis: (..., i) -> (..., o, k), as views only.

    The axis is repeated, flattened and re-cut with a row length of i + d, so that element
    (kk, oo) of the cut lands on x[kk * d + oo * s]; no data is copied until a kernel reads it.
    """
    i = x.shape[-1]
    o = (i - d * (k - 1) - 1) // s + 1
    if o <= 0:
        raise ValueError(f"window of {k} (dilation {d}) does not fit an input of size {i}")
    lead = x.shape[:-1]
    e = -(-k * (i + d) // i)
    x = x.unsqueeze(-2).expand(lead + (e, i)).reshape(lead + (e * i,))
    x = x.shrink([(0, n) for n in lead] + [(0, k * (i + d))]).reshape(lead + (k, i + d))
    if o * s > i + d:
        x = x.pad([0, o * s - (i + d)])
    x = x.shrink([(0, n) for n in lead] + [(0, k), (0, o * s)]).reshape(lead + (k, o, s))
    x = x.shrink([(0, n) for n in lead] + [(0, k), (0, o), (0, 1)]).reshape(lead + (k, o))
    return x.transpose(-1, -2)


def unfold2d(x: Tensor, kernel: tuple[int, int], stride: tuple[int, int],
             dilation: tuple[int, int]) -> Tensor:
    """(N, C, H, W) -> (N, C, OH, OW, KH, KW) windows, as a view."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    x = _pool1d(x, kw, sw, dw)  # N C H OW KW
    x = x.permute(0, 1, 3, 4, 2)  # N C OW KW H
    x = _pool1d(x, kh, sh, dh)  # N C OW KW OH KH
    return x.permute(0, 1, 4, 2, 5, 3)


def conv2d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntPair = 1,
           padding: IntPair | str = 0, dilation: IntPair = 1, groups: int = 1) -> Tensor:
    """2-D convolution (cross-correlation, as PyTorch) of (N, C, H, W) with (O, C/groups, KH, KW).
    """
    if input.ndim != 4 or weight.ndim != 4:
        raise ValueError(f"conv2d expects a 4-D input and weight, got {input.shape} and "
                         f"{weight.shape}")
    n, c, h, w = input.shape
    o, cg, kh, kw = weight.shape
    if groups < 1 or c % groups or o % groups:
        raise ValueError(f"conv2d: groups={groups} must divide in_channels={c} and "
                         f"out_channels={o}")
    if cg != c // groups:
        raise ValueError(f"conv2d: weight {weight.shape} expects {cg * groups} input channels, "
                         f"input has {c}")
    st, dil = _pair(stride, "stride"), _pair(dilation, "dilation")
    if isinstance(padding, str):
        if padding == "valid":
            pad = (0, 0)
        elif padding == "same":
            if st != (1, 1):
                raise ValueError("padding='same' needs stride 1")
            total = (dil[0] * (kh - 1), dil[1] * (kw - 1))
            x = input.pad([total[1] // 2, total[1] - total[1] // 2,
                           total[0] // 2, total[0] - total[0] // 2])
            return _conv(x, weight, bias, st, dil, groups)
        else:
            raise ValueError(f"padding must be 'same', 'valid', an int or a pair, not {padding!r}")
    else:
        pad = _pair(padding, "padding")
    x = input.pad([pad[1], pad[1], pad[0], pad[0]]) if pad != (0, 0) else input
    return _conv(x, weight, bias, st, dil, groups)


def _conv(x: Tensor, weight: Tensor, bias: Tensor | None, stride: tuple[int, int],
          dilation: tuple[int, int], groups: int) -> Tensor:
    n, c = x.shape[:2]
    o, cg, kh, kw = weight.shape
    win = unfold2d(x, (kh, kw), stride, dilation)  # N C OH OW KH KW
    oh, ow = win.shape[2:4]
    g, og = groups, o // groups
    # N G 1 OH OW Cg KH KW  x  1 G Og 1 1 Cg KH KW  -> sum over Cg KH KW
    win = win.reshape(n, g, cg, oh, ow, kh, kw).permute(0, 1, 3, 4, 2, 5, 6).unsqueeze(2)
    wt = weight.reshape(1, g, og, 1, 1, cg, kh, kw)
    out = (win * wt).sum((5, 6, 7))
    out = out.reshape(n, o, oh, ow).cast(x.dtype)
    if bias is not None:
        out = out + bias.reshape(1, o, 1, 1)
    return out


def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``input @ weight.T + bias`` with weight of shape (out_features, in_features)."""
    out = input.matmul(weight.T)
    return out + bias if bias is not None else out


def relu(x: Tensor) -> Tensor:
    return x.relu()


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return x.gelu(approximate)


def silu(x: Tensor) -> Tensor:
    return x.silu()


def sigmoid(x: Tensor) -> Tensor:
    return x.sigmoid()


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    return x.softmax(dim)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    return x.log_softmax(dim)


def pad(x: Tensor, pad: Sequence[int], mode: str = "constant", value: float = 0.0) -> Tensor:
    """PyTorch's ``F.pad``: modes 'constant', 'reflect', 'replicate' and 'circular'."""
    if mode == "constant":
        return x.pad(pad, value)
    if mode not in ("reflect", "replicate", "circular"):
        raise ValueError(f"unknown padding mode {mode!r}")
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise ValueError(f"padding {tuple(pad)} does not fit {x.ndim} dimensions")
    for i in range(len(pad) // 2):
        axis, before, after = x.ndim - 1 - i, int(pad[2 * i]), int(pad[2 * i + 1])
        n = x.shape[axis]
        limit = n - 1 if mode == "reflect" else n
        if mode != "replicate" and (before > limit or after > limit):
            raise ValueError(f"{mode} padding of {(before, after)} is too large for size {n}")

        def part(a: int, b: int) -> Tensor:
            return x.shrink([(a, b) if k == axis else (0, m) for k, m in enumerate(x.shape)])

        pieces = []
        if mode == "circular":
            pieces = [part(n - before, n), x, part(0, after)]
        elif mode == "reflect":
            pieces = [part(1, before + 1).flip(axis), x, part(n - after - 1, n - 1).flip(axis)]
        else:
            shape = lambda k: x.shape[:axis] + (k,) + x.shape[axis + 1:]  # noqa: E731
            pieces = [part(0, 1).expand(shape(before)), x, part(n - 1, n).expand(shape(after))]
        x = cat([p for p in pieces if p.shape[axis]], axis)
    return x


