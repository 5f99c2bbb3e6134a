"""Convolutions with PyTorch's names and signatures (``anygpu.nn.functional`` gives them):
``conv1d``, ``conv2d`` and their transposes as window views summed against the weight (an
implicit GEMM for the templates; im2col and BLAS on the processor), and Winograd's F(2x2, 3x3)
for 3x3 stride-1 convolutions where it wins.

>>> import anygpu as ag
>>> from anygpu.nn import functional as F
>>> x = ag.ones(1, 1, 4, 4)
>>> F.conv2d(x, ag.ones(1, 1, 3, 3), padding=1).shape
(1, 1, 4, 4)
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

from anygpu import amp
from anygpu import dtype as dt
from anygpu.ops.grad import is_grad_enabled
from anygpu.ops.linalg import get_float32_matmul_precision
from anygpu.runtime.registry import get_device
from anygpu.tensor import Tensor, stack, tensor

IntPair = Union[int, Sequence[int]]


def _pair(v: IntPair, name: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    t = tuple(int(x) for x in v)
    if len(t) != 2:
        raise ValueError(f"{name} must be an int or a pair, got {v!r}")
    return t


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
    input, weight, bias = amp.lower(input, weight, bias)
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
    input, weight = _channels_to_run(input, weight, groups)
    if isinstance(padding, str):
        if padding == "valid":
            pad = (0, 0)
        elif padding == "same":
            if st != (1, 1):
                raise ValueError("padding='same' needs stride 1")
            total = (dil[0] * (kh - 1), dil[1] * (kw - 1))
            pads = (total[1] // 2, total[1] - total[1] // 2, total[0] // 2,
                    total[0] - total[0] // 2)
            return _conv(input.pad(list(pads)), weight, bias, st, dil, groups, pads)
        else:
            raise ValueError(f"padding must be 'same', 'valid', an int or a pair, not {padding!r}")
    else:
        pad = _pair(padding, "padding")
    if pad == (0, 0):
        return _conv(input, weight, bias, st, dil, groups)
    pads = (pad[1], pad[1], pad[0], pad[0])
    return _conv(input.pad(list(pads)), weight, bias, st, dil, groups, pads)


def _channels_to_run(x: Tensor, weight: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """On devices whose tensor cores read a convolution's input stored channels-last
    (``schedule.channels_last_windows``), an input of fewer than 8 channels (an image's three)
    and its weight padded with zero channels to 8: the sums stay the
    same, and the tensor cores take a first layer that the SIMT template ran at 8-10 TFLOP/s
    (VGG-16's, 0.55 ms of a bf16 step on an H100). The weight's gradient is cut back to its
    channels by the padding's own rule."""
    from anygpu.graph.schedule import channels_last_windows  # (the graph builds on nn)

    # 8 channels: a 16-byte run of 16-bit ones, and tf32's summed elements a multiple of 8
    c, run = x.shape[1], 8
    if groups != 1 or c >= run or weight.shape[2] * weight.shape[3] == 1 or \
            x.dtype != weight.dtype or not channels_last_windows(x.device, x.dtype):
        return x, weight
    return x.pad([0, 0, 0, 0, 0, run - c]), weight.pad([0, 0, 0, 0, 0, run - c])


def _single(v: IntPair, name: str) -> int:
    if isinstance(v, int):
        return v
    t = tuple(int(x) for x in v)
    if len(t) != 1:
        raise ValueError(f"{name} must be an int or a 1-tuple, got {v!r}")
    return t[0]


def _batched1d(x: Tensor, weight: Tensor, name: str) -> tuple[Tensor, bool]:
    """(N, C, L) from a 2-D (C, L) or 3-D input, and whether a batch axis was added."""
    if x.ndim not in (2, 3):
        raise ValueError(f"Expected 2D (unbatched) or 3D (batched) input to {name}, but got "
                         f"input of size: {list(x.shape)}")
    if weight.ndim != 3:
        raise ValueError(f"{name} expects a 3-D weight, got {weight.shape}")
    return (x.unsqueeze(0), True) if x.ndim == 2 else (x, False)


def conv1d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntPair = 1,
           padding: IntPair | str = 0, dilation: IntPair = 1, groups: int = 1) -> Tensor:
    """1-D convolution of (N, C, L) or unbatched (C, L) with (O, C/groups, K): ``conv2d`` of
    a height-1 image, so it runs through the same kernels. ``padding`` may be 'same' (stride 1)
    or 'valid'.

    >>> import anygpu as ag
    >>> from anygpu.nn import functional as F
    >>> F.conv1d(ag.randn(2, 4, 11), ag.randn(6, 2, 3), stride=2, groups=2).shape
    (2, 6, 5)
    """
    x, unbatched = _batched1d(input, weight, "conv1d")
    pad = padding if isinstance(padding, str) else (0, _single(padding, "padding"))
    out = conv2d(x.unsqueeze(2), weight.unsqueeze(2), bias, (1, _single(stride, "stride")), pad,
                 (1, _single(dilation, "dilation")), groups).squeeze(2)
    return out.squeeze(0) if unbatched else out


def _conv(x: Tensor, weight: Tensor, bias: Tensor | None, stride: tuple[int, int],
          dilation: tuple[int, int], groups: int,
          pads: tuple[int, int, int, int] | None = None) -> Tensor:
    """The convolution of ``x``; ``pads`` (left, right, top, bottom): the zeros ``x`` was
    padded with by the caller, for this convolution alone."""
    n, c = x.shape[:2]
    o, cg, kh, kw = weight.shape
    if (kh, kw, stride, dilation, groups) == (3, 3, (1, 1), (1, 1), 1) and \
            _winograd_wins(x, weight):
        return winograd_3x3(x, weight, bias)
    if (stride, dilation, groups) == ((1, 1), (1, 1), 1) and kh * kw > 1 and \
            _gradient_convolves(x.device) and is_grad_enabled() and x.requires_grad:
        # its data gradient is a convolution itself (``conv2d_grad``), over the unpadded input
        # alone where the padding is this convolution's own
        inside = pads if pads is not None and max(pads[:2]) < kw and max(pads[2:]) < kh \
            else None
        out = x._custom("conv2d", (weight,), inside, lambda: _windows_product(x, weight, 1))
    else:
        out = _windows_product(x, weight, groups, stride, dilation)
    out = out.cast(x.dtype)
    if bias is not None:
        out = out + bias.reshape(1, o, 1, 1)
    return out


def _gradient_convolves(device: str) -> bool:
    """Whether a convolution's data gradient on ``device`` is computed as a convolution of the
    output's gradient (``conv2d_grad``): on GPUs; the processor's BLAS takes the windows'."""
    return not device.startswith("cpu")


def _windows_product(x: Tensor, weight: Tensor, groups: int,
                     stride: tuple[int, int] = (1, 1),
                     dilation: tuple[int, int] = (1, 1)) -> Tensor:
    """The convolution of a padded input as the sum of its windows times the weight (an
    implicit GEMM for the templates)."""
    n = x.shape[0]
    o, cg, kh, kw = weight.shape
    g, og = groups, o // groups
    if kh == kw == 1:
        # a pointwise convolution: the product of the (strided) input with the weight, no
        # windows; through the windows' views, its data gradient was written by the product in
        # the windows' layout and moved into the input's by a kernel of its own (ResNet-50: 36
        # such passes of up to 51 MB a step)
        if stride != (1, 1):
            x = x[:, :, ::stride[0], ::stride[1]]
        oh, ow = x.shape[2:]
        xs = x.reshape(n, g, 1, cg, oh, ow)
        wt = weight.reshape(1, g, og, cg, 1, 1)
        return (xs * wt).sum(3).reshape(n, o, oh, ow)
    win = unfold2d(x, (kh, kw), stride, dilation)  # N C OH OW KH KW
    oh, ow = win.shape[2:4]
    # N G 1 OH OW Cg KH KW  x  1 G Og 1 1 Cg KH KW  -> sum over Cg KH KW
    win = win.reshape(n, g, cg, oh, ow, kh, kw).permute(0, 1, 3, 4, 2, 5, 6).unsqueeze(2)
    wt = weight.reshape(1, g, og, 1, 1, cg, kh, kw)
    return (win * wt).sum((5, 6, 7)).reshape(n, o, oh, ow)


def conv2d_grad(out: Tensor, parents: tuple[Tensor, ...], arg: object, g: Tensor
               ) -> tuple[Tensor | None, Tensor | None]:
    """The gradients of a stride-1, ungrouped convolution of a padded input (``_conv``): the
    input's is the convolution of the output's gradient, padded by the kernel's size less one,
    with the weight flipped and its channels swapped, which the templates compute as a product
    written in place; the chain of the windows' views had summed overlapping windows (col2im)
    after a product of nine times the input's size (VGG-16's 64-channel layers at 224 x 224:
    2.9 ms of such sums a step on an H200). Where ``arg`` gives the padding (left, right, top,
    bottom) that only this convolution reads, the gradient is computed inside it alone and
    padded with zeros, which the padding's own rule drops: 224 x 224 pixels, not 226 x 226
    (whose count is no multiple of 8, which had the 16-bit products' windows written out with
    the channels inner, at a quarter of the speed). The weight's is the product of the windows
    with the output's gradient, as the views' rules give it."""
    x, weight = parents
    o, c, kh, kw = weight.shape
    n, _, oh, ow = g.shape
    dx = None
    if x.requires_grad:
        flipped = weight.permute(1, 0, 2, 3).flip((2, 3))
        if arg is None:
            dx = _conv(g.pad([kw - 1, kw - 1, kh - 1, kh - 1]), flipped, None, (1, 1), (1, 1), 1)
        else:
            assert isinstance(arg, tuple)
            left, right, top, bottom = arg
            dx = _conv(g.pad([kw - 1 - left, kw - 1 - right, kh - 1 - top, kh - 1 - bottom]),
                       flipped, None, (1, 1), (1, 1), 1).pad([left, right, top, bottom])
    dw = None
    if weight.requires_grad:
        from anygpu.graph.schedule import channels_last_windows  # (the graph builds on nn)
        win = unfold2d(x, (kh, kw), (1, 1), (1, 1))
        if channels_last_windows(x.device, x.dtype) and x.dtype == dt.float32 and kw > 1 and \
                ow % 4 == 0 and kw * x.numel() * 4 <= SHIFTED_MAX:
            dw = _weight_grad_by_columns(x, g, kh, kw)
        elif channels_last_windows(x.device, x.dtype):
            # the windows' channels last, where the tensor cores read the padded input stored
            # with its channels innermost (as the forward product does): no windows written
            win = win.reshape(n, 1, c, oh, ow, kh, kw).permute(0, 1, 3, 4, 5, 6, 2).unsqueeze(2)
            grad = g.reshape(n, 1, o, oh, ow, 1, 1, 1).expand(n, 1, o, oh, ow, kh, kw, c)
            dw = (grad * win).sum((0, 3, 4)).reshape(o, kh, kw, c).permute(0, 3, 1, 2)
        else:
            win = win.reshape(n, 1, c, oh, ow, kh, kw).permute(0, 1, 3, 4, 2, 5, 6).unsqueeze(2)
            grad = g.reshape(n, 1, o, oh, ow, 1, 1, 1).expand(n, 1, o, oh, ow, c, kh, kw)
            dw = (grad * win).sum((0, 3, 4)).reshape(o, c, kh, kw)
    return dx, dw


# bytes of the column-shifted copies a tf32 weight gradient may store (_weight_grad_by_columns).
# VGG-16's 64-channel layer at 224 x 224 takes 622 MB at batch 16: with it, the tf32 step on an
# H200 peaked at 3,403 MiB, over PyTorch's 3,326; without it (this limit), at 3,131 MiB and
# 14.14 ms (all layers: 14.10; none, the weight gradients on the register-staged template:
# 16.03; PyTorch 16.48)
SHIFTED_MAX = 1 << 29


def _weight_grad_by_columns(x: Tensor, g: Tensor, kh: int, kw: int) -> Tensor:
    """The weight gradient of a stride-1 convolution of the padded input ``x`` in tf32, with
    both operands read along the pixels they sum over, as the warpgroup template reads tf32
    tiles (its instruction transposes 16-bit tiles only): ``x`` is stored once for each of the
    kernel's columns, shifted by that column (so each window's row of pixels starts on a
    16-byte boundary), and the windows over the kernel's rows are views of those copies. Read
    channels inner (as 16-bit types are), tf32 tiles took the register-staged mma.sync
    template: VGG-16's 3x3 weight gradients ran at 73-75 TFLOP/s on an H100. Rows of the
    product are the output's channels, or (channel, row, column) of the input where the output
    has fewer than 128 channels (a warpgroup's tile)."""
    n, c, hp, _ = x.shape
    _, o, oh, ow = g.shape
    shifted = stack([x[:, :, :, j:j + ow] for j in range(kw)])  # KW N C HP OW
    win = unfold2d(shifted.reshape(kw * n, c, hp, ow), (kh, 1), (1, 1), (1, 1))
    win = win.reshape(kw, n, c, oh, ow, kh).permute(2, 5, 0, 1, 3, 4)  # C KH KW N OH OW
    grad = g.permute(1, 0, 2, 3)  # O N OH OW
    if o >= 128:
        return (grad.reshape(o, 1, 1, 1, n, oh, ow) * win.unsqueeze(0)).sum((4, 5, 6))
    return (win.unsqueeze(3) * grad.reshape(1, 1, 1, o, n, oh, ow)).sum((4, 5, 6)) \
        .permute(3, 0, 1, 2)


WINOGRAD: bool | None = None  # None: where it wins (_winograd_wins); True or False: always, never
# the most bytes of a layer's transformed input tiles that its backward pass computes again
# rather than holding them from the forward pass (ResNet-50's, at most 24.5 MiB at batch 16 and
# 224 x 224: its fp32 step's peak fell from 1,800 to 1,657 MiB on an H200, in the same time;
# VGG-16's, 24.5 to 196 MiB, cost 2 ms of its 45 ms step all computed again)
WINOGRAD_RECOMPUTE = 64 << 20


def _winograd_wins(x: Tensor, weight: Tensor) -> bool:
    """Whether a 3x3 stride-1 convolution runs as Winograd's F(2x2, 3x3) (``winograd_3x3``):
    in exact float32 on GPUs, from 128 channels on. Measured on an H100 against the direct
    implicit GEMM, ResNet-50's layers at batch 16: forward 0.7-1.0x the time at 256 and 512,
    the gradients 0.55-0.85x at 128 to 512, and a loss at 64 (forward 1.3x); VGG-16's fp32 step
    on an H200 took 43.6 ms with it, 78.7 without. Where float32 products may run as tf32 on
    tensor cores (CUDA from compute capability 8.0), the direct convolution's unfolded windows
    go to them and win: VGG-16's tf32 step 27.1 ms against 37.4, ResNet-50's 14.1 against
    15.5, ResNet-18's 6.0 against 7.4 (H200); where its windows stay where they lie (a small
    product, or windows over 1 GiB), Winograd stays. On the processor BLAS's direct product
    is faster (the gradients 1.4x slower by Winograd). float16 and bfloat16 stay direct: their
    transformed tiles would round to 16 bits."""
    if WINOGRAD is not None:
        return WINOGRAD
    channels = min(x.shape[1], weight.shape[0])
    if x.device.startswith("cpu") or x.dtype != dt.float32 or weight.dtype != dt.float32 or \
            channels < 128:
        return False
    device = get_device(x.device)
    if get_float32_matmul_precision() == "highest" or device.dialect != "cuda" or \
            device.info.extra.get("cc", (0, 0)) < (8, 0):
        return True
    from anygpu.graph.schedule import unfolds_on_gpu  # (the graph builds on nn's ops)
    n, c, h, w = x.shape
    windows = n * c * 9 * (h - 2) * (w - 2)
    return not unfolds_on_gpu(windows * weight.shape[0], windows * 4)


# Winograd's F(2x2, 3x3) (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks",
# 2016): 2x2 outputs from a 4x4 input tile in 16 products instead of 36. Input tiles are
# transformed by B^T d B, filters by G g G^T, products back by A^T m A.
_BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float32)
_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], np.float32)
_AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float32)
_winograd_constants: dict[tuple[str, str], tuple[Tensor, Tensor, Tensor]] = {}


def _winograd_matrices(device: str) -> tuple[Tensor, Tensor, Tensor]:
    """The three transforms as tensors on ``device``, each the outer product of its matrix with
    itself: input (a, b, p, q, p', q') for tile row 2p + q and column 2p' + q', filter (a, b, k,
    l) and output (i, j, a, b)."""
    key = (device, "f32")
    if key not in _winograd_constants:
        bt = np.einsum("ai,bj->abij", _BT, _BT).reshape(4, 4, 2, 2, 2, 2)
        g = np.einsum("ak,bl->abkl", _G, _G)
        at = np.einsum("ia,jb->ijab", _AT, _AT)
        _winograd_constants[key] = tuple(  # type: ignore[assignment]
            tensor(np.ascontiguousarray(m), device=device).realize() for m in (bt, g, at))
    return _winograd_constants[key]


def winograd_3x3(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """A 3x3, stride-1 convolution of an already padded (N, C, H, W) input by Winograd's
    F(2x2, 3x3): the input's overlapping 4x4 tiles and the filters are transformed by constant
    matrices, multiplied as 16 independent (O, C) x (C, tiles) products, and every 4x4 product
    tile is transformed back into 2x2 outputs: 2.25 times fewer multiply-adds than the direct
    convolution, for four times the input and output written in between.

    >>> import anygpu as ag
    >>> x, w = ag.randn(1, 2, 6, 6), ag.randn(3, 2, 3, 3)
    >>> (winograd_3x3(x, w) - conv2d(x, w)).abs().max().item() < 1e-4
    True
    """
    n, c, h, w = x.shape
    o = weight.shape[0]
    oh, ow = h - 2, w - 2
    th, tw = -(-oh // 2), -(-ow // 2)
    if 2 * th + 2 > h or 2 * tw + 2 > w:  # an odd output size: one more row or column of zeros
        x = x.pad([0, 2 * tw + 2 - w, 0, 2 * th + 2 - h])
    at = _winograd_matrices(x.device)[2]
    if is_grad_enabled() and (weight.requires_grad or x.requires_grad):
        # the product by a rule of its own, which transforms the filters again from the weight,
        # and the input's tiles from the input where they take at most WINOGRAD_RECOMPUTE bytes:
        # through the chain of its primitives, both transforms (16 x O x C, and four times the
        # input's size) were held from the forward pass to the backward one for every layer
        if 16 * x.shape[1] * n * th * tw * 4 <= WINOGRAD_RECOMPUTE:
            m = weight._custom("winograd_product", (x,), ("input", th, tw),
                               lambda: _winograd_filters(weight) @ _winograd_tiles(x, th, tw))
        else:
            v = _winograd_tiles(x, th, tw)
            m = weight._custom("winograd_product", (v,), ("tiles", th, tw),
                               lambda: _winograd_filters(weight) @ v)
    else:
        m = _winograd_filters(weight) @ _winograd_tiles(x, th, tw)
    m = m.reshape(4, 4, o, n, th, tw)
    # summed in the output's own order (N O TH i TW j), so that it is written once, bias included
    m = m.permute(3, 2, 4, 5, 0, 1).reshape(n, o, th, 1, tw, 1, 4, 4)
    y = (m * at.reshape(1, 1, 1, 2, 1, 2, 4, 4)).sum((6, 7))
    y = y.reshape(n, o, 2 * th, 2 * tw)
    if (2 * th, 2 * tw) != (oh, ow):
        y = y.shrink([(0, n), (0, o), (0, oh), (0, ow)])
    y = y.cast(x.dtype)
    return y + bias.reshape(1, o, 1, 1) if bias is not None else y


def _winograd_filters(weight: Tensor) -> Tensor:
    """(O, C, 3, 3) filters transformed by G g G^T: (16, O, C)."""
    o, c = weight.shape[:2]
    g = _winograd_matrices(weight.device)[1]
    return (weight.unsqueeze(0).unsqueeze(0) * g.reshape(4, 4, 1, 1, 3, 3)).sum((4, 5)).reshape(
        16, o, c)


def _winograd_tiles(x: Tensor, th: int, tw: int) -> Tensor:
    """The input's overlapping 4x4 tiles, TH x TW of them at stride 2 (x is (N, C, 2 TH + 2,
    2 TW + 2)), transformed by B^T d B: (16, C, N * TH * TW)."""
    n, c = x.shape[:2]
    bt = _winograd_matrices(x.device)[0]
    # tile (ty, tx)'s row 2p + q is row ty + p of the (TH + 1, 2)-cut rows: windows of 2 at stride 1
    rows = x.reshape(n, c, th + 1, 2, tw + 1, 2).permute(0, 1, 3, 5, 2, 4)  # N C q q' TH+1 TW+1
    d = unfold2d(rows.reshape(n, c * 4, th + 1, tw + 1), (2, 2), (1, 1), (1, 1))
    d = d.reshape(n, c, 2, 2, th, tw, 2, 2).permute(1, 0, 4, 5, 6, 2, 7, 3)  # C N TH TW p q p' q'
    return (d.unsqueeze(0).unsqueeze(0) * bt.reshape(4, 4, 1, 1, 1, 1, 2, 2, 2, 2)).sum(
        (6, 7, 8, 9)).reshape(16, c, n * th * tw)


def _winograd_tiles_grad(dv: Tensor, n: int, th: int, tw: int) -> Tensor:
    """The adjoint of ``_winograd_tiles``: each tile's gradient transformed back by B (.) B^T and
    added where the overlapping tiles read the input (tile (ty, tx)'s row 2p + q is input row
    2 (ty + p) + q): (N, C, 2 TH + 2, 2 TW + 2)."""
    c = dv.shape[1]
    bt = _winograd_matrices(dv.device)[0]
    t = (dv.reshape(4, 4, 1, 1, 1, 1, c, n, th, tw) *
         bt.reshape(4, 4, 2, 2, 2, 2, 1, 1, 1, 1)).sum((0, 1))  # p q p' q' C N TH TW
    total: Tensor | None = None
    for p in (0, 1):
        for pp in (0, 1):
            part = t.shrink([(p, p + 1), (0, 2), (pp, pp + 1), (0, 2), (0, c), (0, n), (0, th),
                             (0, tw)]).reshape(2, 2, c, n, th, tw)
            part = part.pad([pp, 1 - pp, p, 1 - p])  # q q' C N TH+1 TW+1, tile ty at row ty + p
            total = part if total is None else total + part
    assert total is not None
    return total.permute(3, 2, 4, 0, 5, 1).reshape(n, c, 2 * th + 2, 2 * tw + 2)


def winograd_product_grad(out: Tensor, parents: tuple[Tensor, ...], arg: object, g: Tensor
                          ) -> tuple[Tensor | None, Tensor | None]:
    """The gradients of Winograd's 16 products U V (``winograd_3x3``: U the filters' transform,
    V the input tiles') with respect to the filters and to the second parent: the (tile-aligned)
    input, whose tiles are transformed again here (``arg`` ("input", TH, TW)), or the tiles
    themselves, held since the forward pass (("tiles", TH, TW)). U is computed again."""
    weight, second = parents
    assert isinstance(arg, tuple)
    kind, th, tw = arg
    o, c = weight.shape[:2]
    dw = ds = None
    if weight.requires_grad:
        v = _winograd_tiles(second, th, tw) if kind == "input" else second
        du = (g @ v.transpose(1, 2)).reshape(4, 4, o, c, 1, 1)
        gm = _winograd_matrices(weight.device)[1].reshape(4, 4, 1, 1, 3, 3)
        dw = (du * gm).sum((0, 1))
    if second.requires_grad:
        ds = _winograd_filters(weight).transpose(1, 2) @ g
        if kind == "input":
            ds = _winograd_tiles_grad(ds, second.shape[0], th, tw)
    return dw, ds


def _batched(x: Tensor, name: str) -> tuple[Tensor, bool]:
    """(N, C, H, W) from a 3-D (C, H, W) or 4-D input, and whether a batch axis was added."""
    if x.ndim == 3:
        return x.unsqueeze(0), True
    if x.ndim != 4:
        raise ValueError(f"{name} expects a 3-D or 4-D input, got shape {x.shape}")
    return x, False


# ---- transposed convolution --------------------------------------------------------------------
def conv_transpose2d(input: Tensor, weight: Tensor, bias: Tensor | None = None,
                     stride: IntPair = 1, padding: IntPair = 0, output_padding: IntPair = 0,
                     groups: int = 1, dilation: IntPair = 1) -> Tensor:
    """The gradient of ``conv2d`` with respect to its input, with weight (C_in, C_out/groups,
    KH, KW): a stride-1 convolution over the input with ``stride - 1`` zeros between elements,
    padded by ``dilation * (k - 1) - padding``, with the flipped, transposed weight."""
    input, weight, bias = amp.lower(input, weight, bias)
    x, unbatched = _batched(input, "conv_transpose2d")
    n, c, h, w = x.shape
    if weight.ndim != 4 or weight.shape[0] != c:
        raise ValueError(f"conv_transpose2d: weight {weight.shape} does not fit input {x.shape}")
    if groups < 1 or c % groups:
        raise ValueError(f"conv_transpose2d: groups={groups} must divide in_channels={c}")
    _, og, kh, kw = weight.shape
    (sh, sw), (ph, pw) = _pair(stride, "stride"), _pair(padding, "padding")
    (oph, opw), (dh, dw) = _pair(output_padding, "output_padding"), _pair(dilation, "dilation")
    if oph >= max(sh, dh) or opw >= max(sw, dw):
        raise ValueError("output_padding must be smaller than either stride or dilation")
    if sh > 1 or sw > 1:
        x = x.reshape(n, c, h, 1, w, 1).pad([0, sw - 1, 0, 0, 0, sh - 1])
        x = x.reshape(n, c, h * sh, w * sw).shrink(
            [(0, n), (0, c), (0, (h - 1) * sh + 1), (0, (w - 1) * sw + 1)])
    eh, ew = dh * (kh - 1) - ph, dw * (kw - 1) - pw
    x = x.pad([ew, ew + opw, eh, eh + oph])
    g = groups
    wt = weight.reshape(g, c // g, og, kh, kw).transpose(1, 2).reshape(g * og, c // g, kh, kw)
    out = _conv(x, wt.flip(2, 3), bias, (1, 1), (dh, dw), g)
    return out.squeeze(0) if unbatched else out


def conv_transpose1d(input: Tensor, weight: Tensor, bias: Tensor | None = None,
                     stride: IntPair = 1, padding: IntPair = 0, output_padding: IntPair = 0,
                     groups: int = 1, dilation: IntPair = 1) -> Tensor:
    """The gradient of ``conv1d`` with respect to its input, weight (C_in, C_out/groups, K),
    input (N, C_in, L) or unbatched (C_in, L): ``conv_transpose2d`` of a height-1 image.

    >>> import anygpu as ag
    >>> from anygpu.nn import functional as F
    >>> F.conv_transpose1d(ag.randn(1, 4, 5), ag.randn(4, 3, 3), stride=2, padding=1,
    ...                    output_padding=1).shape
    (1, 3, 10)
    """
    x, unbatched = _batched1d(input, weight, "conv_transpose1d")
    out = conv_transpose2d(x.unsqueeze(2), weight.unsqueeze(2), bias,
                           (1, _single(stride, "stride")), (0, _single(padding, "padding")),
                           (0, _single(output_padding, "output_padding")), groups,
                           (1, _single(dilation, "dilation"))).squeeze(2)
    return out.squeeze(0) if unbatched else out
