"""Signal operators: DFT (forward, inverse, one-sided), STFT and the Hann, Hamming and
Blackman windows.

A transform is a product with cosine and sine tables of the transform's length, built on the
device from the exact integer phase ``k * n mod N``, so long transforms keep their accuracy.

>>> import numpy as np
>>> from anygpu.onnx.ops.table import Node
>>> node = Node("DFT", "d", "", 20, "cpu", {}, [1], [1], 1)
>>> x = Tensor(np.array([[[1.0], [0.0], [0.0], [0.0]]], np.float32))
>>> dft(node, x).reshape(-1).tolist()
[1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
"""

from __future__ import annotations

import math

import numpy as np

from anygpu import dtype as dt
from anygpu.nn.convolution import _pool1d
from anygpu.onnx import dtypes
from anygpu.onnx.ops.common import axis as norm_axis
from anygpu.onnx.ops.common import const, scalar
from anygpu.onnx.ops.table import Node, op
from anygpu.tensor import Tensor, arange, stack, where


def _tables(rows: int, cols: int, length: int, device: str) -> tuple[Tensor, Tensor]:
    """cos and sin of 2 pi k n / length for k < rows, n < cols, as (rows, cols)."""
    k = arange(rows, device=device, dtype=dt.int64).reshape(rows, 1)
    n = arange(cols, device=device, dtype=dt.int64).reshape(1, cols)
    # the phase in quarter turns, split exactly (in integers) into the nearest quarter turn
    # and a remainder within an eighth of a turn: quarter turns then give exact 0 and 1
    quarters = ((k * n) % length) * 4
    turn = (quarters * 2 + length).div(2 * length, rounding_mode="floor")  # round(q / N)
    rest = (quarters - turn * length).cast(dt.float32) * (math.pi / 2 / length)
    c, s = rest.cos(), rest.sin()
    quadrant = turn % 4
    cos = where(quadrant.eq(0), c, where(quadrant.eq(1), -s, where(quadrant.eq(2), -c, s)))
    sin = where(quadrant.eq(0), s, where(quadrant.eq(1), c, where(quadrant.eq(2), -s, -c)))
    return cos, sin


def _fit(x: Tensor, length: int) -> Tensor:
    """The last axis cut or zero-padded to ``length``."""
    n = x.shape[-1]
    if n > length:
        return x.shrink([(0, m) for m in x.shape[:-1]] + [(0, length)])
    if n < length:
        return x.pad([0, length - n])
    return x


def transform(re: Tensor, im: Tensor | None, length: int, inverse: bool, onesided: bool
              ) -> tuple[Tensor, Tensor | None]:
    """The DFT of a complex signal along its last axis (real and imaginary parts)."""
    if inverse and onesided:  # the real signal of a one-sided (Hermitian) spectrum
        bins = re.shape[-1]
        cos, sin = _tables(length, bins, length, re.device)  # (n, k)
        k = arange(bins, device=re.device, dtype=dt.int64)
        # the bins other than 0 and N/2 stand for their conjugate twins as well
        twice = k.gt(0).logical_and((k * 2).ne(length)).cast(dt.float32) + 1
        out = re.matmul((cos * twice).T)
        if im is not None:
            out = out - im.matmul((sin * twice).T)
        return out / length, None
    re = _fit(re, length)
    im = _fit(im, length) if im is not None else None
    bins = length // 2 + 1 if onesided else length
    cos, sin = _tables(bins, length, length, re.device)
    sign = 1.0 if inverse else -1.0
    out_re = re.matmul(cos.T)
    out_im = re.matmul(sin.T) * sign
    if im is not None:
        out_re = out_re - im.matmul(sin.T) * sign
        out_im = out_im + im.matmul(cos.T)
    if inverse:
        out_re, out_im = out_re / length, out_im / length
    return out_re, out_im


def _dft(node: Node, x: Tensor, length: int | None, a: int) -> Tensor:
    inverse, onesided = bool(node.attr("inverse", 0)), bool(node.attr("onesided", 0))
    a = norm_axis(a, x.ndim, node)
    if a == x.ndim - 1:
        node.fail("axis is the real/imaginary axis")
    xf = x.cast(dt.float32)
    moved = xf.transpose(a, -2)  # the signal axis next to the real/imaginary one
    re = moved[..., 0]
    im = moved[..., 1] if x.shape[-1] == 2 else None
    n = x.shape[a]
    if length is None:
        length = 2 * (n - 1) if inverse and onesided else n
    out_re, out_im = transform(re, im, length, inverse, onesided)
    if out_im is None:
        out = out_re.unsqueeze(-1)
    else:
        out = stack([out_re, out_im], -1)
    return out.transpose(a, -2).cast(x.dtype)


@op("DFT", since=20, attrs=("inverse", "onesided"), host=(1, 2))
def dft(node: Node, x: Tensor, length: np.ndarray | None = None,
        axis_value: np.ndarray | None = None) -> Tensor:
    a = int(scalar(axis_value)) if axis_value is not None else -2
    return _dft(node, x, int(scalar(length)) if length is not None else None, a)


@op("DFT", since=17, until=19, attrs=("axis", "inverse", "onesided"), host=1)
def dft_17(node: Node, x: Tensor, length: np.ndarray | None = None) -> Tensor:
    return _dft(node, x, int(scalar(length)) if length is not None else None,
                node.attr("axis", 1))


@op("STFT", since=17, attrs=("onesided",), host=(1, 3))
def stft(node: Node, x: Tensor, step: np.ndarray, window: Tensor | None = None,
         frame_length: np.ndarray | None = None) -> Tensor:
    hop = int(scalar(step))
    if frame_length is not None:
        size = int(scalar(frame_length))
    else:
        size = window.shape[0] if window is not None else x.shape[-2]
    xf = x.cast(dt.float32)
    re = _pool1d(xf[..., 0], size, hop, 1)  # (batch, frames, size)
    im = _pool1d(xf[..., 1], size, hop, 1) if x.shape[-1] == 2 else None
    if window is not None:
        w = window.cast(dt.float32)
        re = re * w
        im = im * w if im is not None else None
    out_re, out_im = transform(re, im, size, False, bool(node.attr("onesided", 1)))
    assert out_im is not None
    return stack([out_re, out_im], -1).cast(x.dtype)


def _window(node: Node, size: np.ndarray, terms: list[float]) -> Tensor:
    """sum_j terms[j] * cos(2 pi j n / N) over n < size (N = size, or size - 1 if symmetric)."""
    n = int(scalar(size))
    span = n if node.attr("periodic", 1) else n - 1
    i = arange(n, device=node.device, dtype=dt.float32)
    out = None
    for j, coeff in enumerate(terms):
        term = (i * (2 * math.pi * j / span)).cos() * coeff if j else i * 0 + coeff
        out = term if out is None else out + term
    assert out is not None
    elem = node.attr("output_datatype", 1)
    return out.cast(dtypes.storage(elem))


_WINDOW_ATTRS = ("output_datatype", "periodic")


@op("HannWindow", since=17, attrs=_WINDOW_ATTRS, host=0)
def hann_window(node: Node, size: np.ndarray) -> Tensor:
    return _window(node, size, [0.5, -0.5])


@op("HammingWindow", since=17, attrs=_WINDOW_ATTRS, host=0)
def hamming_window(node: Node, size: np.ndarray) -> Tensor:
    alpha = 25.0 / 46.0
    return _window(node, size, [alpha, -(1 - alpha)])


@op("BlackmanWindow", since=17, attrs=_WINDOW_ATTRS, host=0)
def blackman_window(node: Node, size: np.ndarray) -> Tensor:
    return _window(node, size, [0.42, -0.5, 0.08])




@op("MelWeightMatrix", since=17, attrs=("output_datatype",), host=(0, 1, 2, 3, 4))
def mel_weight_matrix(node: Node, bins: np.ndarray, length: np.ndarray, rate: np.ndarray,
                      low: np.ndarray, high: np.ndarray) -> Tensor:
    """Triangular filters mapping the one-sided spectrum of ``length`` to ``bins`` mel bands
    between ``low`` and ``high`` hertz (the edges on the mel scale, 2595 log10(1 + f / 700))."""
    n_mel, n_fft, sr = int(scalar(bins)), int(scalar(length)), float(scalar(rate))
    lo_mel = 2595 * math.log1p(float(scalar(low)) / 700) / math.log(10)
    hi_mel = 2595 * math.log1p(float(scalar(high)) / 700) / math.log(10)
    step = (hi_mel - lo_mel) / (n_mel + 2)
    k = arange(n_mel + 2, device=node.device, dtype=dt.float32) * step + lo_mel
    hz = ((k / 2595 * math.log(10)).expm1() * 700)
    edges = ((hz * (n_fft + 1)) / sr).floor().cast(dt.int64)  # the spectrum bin of each edge
    lower = edges[:-2].reshape(1, n_mel)
    center = edges[1:-1].reshape(1, n_mel)
    upper = edges[2:].reshape(1, n_mel)
    j = arange(n_fft // 2 + 1, device=node.device, dtype=dt.int64).reshape(-1, 1)
    zero = const(0.0, (), dt.float32, node.device)
    rise_len = (center - lower).cast(dt.float32)
    fall_len = (upper - center).cast(dt.float32)
    rising = where(j.ge(lower).logical_and(j.lt(center)),
                   (j - lower).cast(dt.float32) / rise_len.maximum(1.0), zero)
    falling = where(j.gt(center).logical_and(j.lt(upper)),
                    (upper - j).cast(dt.float32) / fall_len.maximum(1.0), zero)
    peak = where(j.eq(center), const(1.0, (), dt.float32, node.device), zero)
    out = rising + falling + peak
    return out.cast(dtypes.storage(node.attr("output_datatype", 1)))


__all__ = ["transform", "dft", "stft", "mel_weight_matrix"]
