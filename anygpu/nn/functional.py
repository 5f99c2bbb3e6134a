"""Functional forms of the layers, with PyTorch's names and signatures.

>>> import anygpu as ag
>>> from anygpu.nn import functional as F
>>> x = ag.ones(1, 1, 4, 4)
>>> F.conv2d(x, ag.ones(1, 1, 3, 3), padding=1).shape
(1, 1, 4, 4)
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from anygpu import amp
from anygpu import dtype as dt
from anygpu.ops.grad import is_grad_enabled
from anygpu.ops.linalg import matmul_transposed
from anygpu.tensor import Tensor, arange, cat, rand, realize, stack, where
from anygpu.nn.distance import cosine_similarity, normalize, pairwise_distance
from anygpu.nn.upsampling import interpolate

from anygpu.nn.convolution import (IntPair, _batched, _pair, conv1d, conv2d, conv_transpose1d,
                                   conv_transpose2d, unfold2d, winograd_3x3)


def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``input @ weight.T + bias`` with weight of shape (out_features, in_features)."""
    input, weight, bias = amp.lower(input, weight, bias)
    if weight.requires_grad and is_grad_enabled() and weight.ndim == 2 and input.ndim >= 1:
        # the weight's gradient in its own layout; without one, ``matmul(weight.T)`` as
        # before (inference's kernels, the decode and quantized paths', unchanged)
        out = matmul_transposed(input, weight)
    else:
        out = input.matmul(weight.T)
    return out + bias if bias is not None else out


def relu(x: Tensor) -> Tensor:
    return x.relu()


def hardtanh(input: Tensor, min_val: float = -1.0, max_val: float = 1.0,
             inplace: bool = False) -> Tensor:
    """``input`` clamped to [min_val, max_val]. Unlike ``clamp``, the gradient is 0 at the
    bounds themselves (PyTorch's rule: it passes where ``min_val < x < max_val``), and NaN
    stays NaN.

    >>> import anygpu as ag
    >>> from anygpu.nn import functional as F
    >>> F.hardtanh(ag.tensor([-2.0, 0.5, 3.0])).tolist()
    [-1.0, 0.5, 1.0]
    """
    if min_val > max_val:
        raise ValueError("min_val cannot be greater than max_val")
    # selects rather than clamp: their gradient reaches x only where neither test holds
    upper = input.ge(max_val)._select(input._const_like(max_val), input)
    return input.le(min_val)._select(input._const_like(min_val), upper)


def relu6(input: Tensor, inplace: bool = False) -> Tensor:
    """``min(max(x, 0), 6)``: ``hardtanh(x, 0, 6)``, with its gradient (0 at 0 and at 6).

    >>> import anygpu as ag
    >>> from anygpu.nn import functional as F
    >>> F.relu6(ag.tensor([-1.0, 3.0, 8.0])).tolist()
    [0.0, 3.0, 6.0]
    """
    return hardtanh(input, 0.0, 6.0)


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


def _part(x: Tensor, axis: int, start: int, stop: int) -> Tensor:
    return x.shrink([(start, stop) if k == axis else (0, m) for k, m in enumerate(x.shape)])


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
        if mode == "circular":
            pieces = [_part(x, axis, n - before, n), x, _part(x, axis, 0, after)]
        elif mode == "reflect":
            pieces = [_part(x, axis, 1, before + 1).flip(axis), x,
                      _part(x, axis, n - after - 1, n - 1).flip(axis)]
        else:
            lead, tail = x.shape[:axis], x.shape[axis + 1:]
            pieces = [_part(x, axis, 0, 1).expand(lead + (before,) + tail), x,
                      _part(x, axis, n - 1, n).expand(lead + (after,) + tail)]
        x = cat([p for p in pieces if p.shape[axis]], axis)
    return x


def leaky_relu(x: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    return x.leaky_relu(negative_slope)


def prelu(input: Tensor, weight: Tensor) -> Tensor:
    """``x`` where positive, else ``weight * x``, with one weight, or one per channel (axis 1;
    an input of fewer than 2 dimensions has one channel).

    >>> import anygpu as ag
    >>> from anygpu.nn import functional as F
    >>> F.prelu(ag.tensor([[-2.0, 3.0]]), ag.tensor([0.25])).tolist()
    [[-0.5, 3.0]]
    """
    if input.dtype != weight.dtype:
        raise RuntimeError(f"prelu: Type promoting not supported. Got {input.dtype.name} and "
                           f"{weight.dtype.name}")
    count = weight.numel()
    if count != 1:
        if input.ndim == 0:
            raise RuntimeError("Not allow zero-dim input tensor.")
        channels = input.shape[1] if input.ndim > 1 else 1
        if channels != count:
            raise RuntimeError(f"Mismatch of parameter numbers and input channel size. Found "
                               f"parameter numbers = {count} and channel size = {channels}.")
    if weight.ndim > 1:
        raise RuntimeError(f"prelu: Expected `weight` to be a scalar or 1D tensor, but got: "
                           f"ndim = {weight.ndim}")
    view = [1] * input.ndim
    if input.ndim > 1:
        view[1] = count
    return where(input.gt(0), input, weight.reshape(view) * input)


def tanh(x: Tensor) -> Tensor:
    return x.tanh()


# ---- pooling -----------------------------------------------------------------------------------
def _pool_size(size: int, k: int, pad: int, s: int, d: int, ceil_mode: bool) -> int:
    """Output length, as PyTorch computes it (a last window that starts in the right padding
    is dropped in ceil mode)."""
    out = (size + 2 * pad - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + pad:
        out -= 1
    if out <= 0:
        raise ValueError(f"pooling window {k} (padding {pad}, dilation {d}) does not fit an "
                         f"input of size {size}")
    return out


def _pool_windows(x: Tensor, k: tuple[int, int], s: tuple[int, int], p: tuple[int, int],
                  d: tuple[int, int], ceil_mode: bool, value: float
                  ) -> tuple[Tensor, tuple[int, int]]:
    """(N, C, OH, OW, KH*KW) windows of ``x`` padded with ``value``, and (OH, OW)."""
    h, w = x.shape[2:]
    oh = _pool_size(h, k[0], p[0], s[0], d[0], ceil_mode)
    ow = _pool_size(w, k[1], p[1], s[1], d[1], ceil_mode)
    # pad (or crop) the right side to exactly the extent the last window needs
    rh = (oh - 1) * s[0] + d[0] * (k[0] - 1) + 1 - h - p[0]
    rw = (ow - 1) * s[1] + d[1] * (k[1] - 1) + 1 - w - p[1]
    xp = x.pad([p[1], rw, p[0], rh], value=value)
    win = unfold2d(xp, k, s, d)
    return win.reshape(win.shape[:4] + (k[0] * k[1],)), (oh, ow)


def max_pool2d(input: Tensor, kernel_size: IntPair, stride: IntPair | None = None,
               padding: IntPair = 0, dilation: IntPair = 1, ceil_mode: bool = False,
               return_indices: bool = False) -> Any:
    """Max over windows; with ``return_indices``, also each maximum's flat index into H*W."""
    x, unbatched = _batched(input, "max_pool2d")
    k = _pair(kernel_size, "kernel_size")
    s = _pair(stride, "stride") if stride is not None and stride != [] else k
    p, d = _pair(padding, "padding"), _pair(dilation, "dilation")
    for kk, pp, dd in zip(k, p, d):
        if pp > (dd * (kk - 1) + 1) // 2:
            raise ValueError(f"pad should be at most half of effective kernel size, got "
                             f"padding={p}, kernel_size={k} and dilation={d}")
    low = float("-inf") if x.dtype.is_float else int(np.iinfo(x.dtype.np).min)
    win, (oh, ow) = _pool_windows(x, k, s, p, d, ceil_mode, low)
    if x.dtype.is_float:
        # the gradient rule (ops/grad.py "max_pool2d") sends each output's gradient to its
        # first maximum directly, one window offset at a time: two kernels, not the chain of
        # the windows' views
        out = x._custom("max_pool2d", (), (k, s, p, d, ceil_mode),
                        lambda: win._max(-1, keepdim=False))
    else:
        out = win._max(-1, keepdim=False)
    if not return_indices:
        return out.squeeze(0) if unbatched else out
    a = win.argmax(-1)  # offset in the window, row-major over (KH, KW)
    rows = arange(oh, device=x.device).reshape(oh, 1) * s[0] - p[0] + (a // k[1]) * d[0]
    cols = arange(ow, device=x.device).reshape(1, ow) * s[1] - p[1] + (a % k[1]) * d[1]
    idx = rows * x.shape[3] + cols
    return (out.squeeze(0), idx.squeeze(0)) if unbatched else (out, idx)


def avg_pool2d(input: Tensor, kernel_size: IntPair, stride: IntPair | None = None,
               padding: IntPair = 0, ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: int | None = None) -> Tensor:
    """Mean over windows; the divisor counts the zero padding with ``count_include_pad`` but
    never the extra windows of ``ceil_mode`` past the padding, as in PyTorch."""
    x, unbatched = _batched(input, "avg_pool2d")
    k = _pair(kernel_size, "kernel_size")
    s = _pair(stride, "stride") if stride is not None and stride != [] else k
    p = _pair(padding, "padding")
    if p[0] > k[0] // 2 or p[1] > k[1] // 2:
        raise ValueError(f"pad should be at most half of kernel size, got padding={p} and "
                         f"kernel_size={k}")
    win, (oh, ow) = _pool_windows(x, k, s, p, (1, 1), ceil_mode, 0.0)
    total = win.sum(-1)
    if divisor_override:
        out = total / divisor_override
    else:
        sizes = []
        for o, size, kk, ss, pp in zip((oh, ow), x.shape[2:], k, s, p):
            start = arange(o, device=x.device, dtype=dt.int32) * ss - pp
            end = (start + kk).minimum(size + pp)
            if not count_include_pad:
                start, end = start.maximum(0), end.minimum(size)
            sizes.append((end - start).float())
        div = sizes[0].reshape(oh, 1) * sizes[1].reshape(1, ow)
        out = total / div.cast(total.dtype)
    out = out.cast(x.dtype)
    return out.squeeze(0) if unbatched else out


def _adaptive_matrix(size: int, out: int, device: str) -> tuple[Tensor, Tensor]:
    """(out, size) 0/1 matrix of which inputs each output averages, and the counts (out, 1):
    window i covers [floor(i * size / out), ceil((i + 1) * size / out))."""
    i = arange(out, device=device, dtype=dt.int32).reshape(out, 1)
    j = arange(size, device=device, dtype=dt.int32).reshape(1, size)
    start = (i * size) // out
    end = ((i + 1) * size + out - 1) // out
    mask = j.ge(start).logical_and(j.lt(end)).float()
    return mask, (end - start).float()


def adaptive_avg_pool2d(input: Tensor, output_size: IntPair | Sequence[int | None]) -> Tensor:
    """Average pooling to a fixed output size (``None`` keeps that input size)."""
    x, unbatched = _batched(input, "adaptive_avg_pool2d")
    h, w = x.shape[2:]
    if isinstance(output_size, int) or output_size is None:
        output_size = (output_size, output_size)
    oh, ow = [n if o is None else int(o) for o, n in zip(output_size, (h, w))]
    if (oh, ow) == (1, 1):
        out = x.mean((2, 3), keepdim=True)
    elif h % oh == 0 and w % ow == 0:
        out = avg_pool2d(x, (h // oh, w // ow))
    else:
        mh, ch = _adaptive_matrix(h, oh, x.device)
        mw, cw = _adaptive_matrix(w, ow, x.device)
        xf = x.float()
        out = mh.matmul(xf.matmul(mw.T)) / (ch * cw.reshape(1, ow))
        out = out.cast(x.dtype)
    return out.squeeze(0) if unbatched else out


# ---- normalization -------------------------------------------------------------------------------
def _moments(x: Tensor, axes: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Mean and biased variance over ``axes`` (kept), computed in float32."""
    xf = x.float()
    mean = xf.mean(axes, keepdim=True)
    diff = xf - mean
    return mean, (diff * diff).mean(axes, keepdim=True)


def batch_norm(input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
               weight: Tensor | None = None, bias: Tensor | None = None, training: bool = False,
               momentum: float | Tensor = 0.1, eps: float = 1e-5) -> Tensor:
    """Normalize over every axis but the channels (axis 1). In training the batch statistics
    are used, and the running ones, when given, are updated in place as in PyTorch (kernels are
    queued, nothing waits for the device; a ``jit``-captured step replays the update)."""
    if input.ndim < 2:
        raise ValueError(f"batch_norm expects at least 2 dimensions, got {input.shape}")
    c = input.shape[1]
    axes = tuple(a for a in range(input.ndim) if a != 1)
    view = (1, c) + (1,) * (input.ndim - 2)
    if training:
        count = input.numel() // c
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input "
                             f"size {input.shape}")
        mean, var = _moments(input, axes)
        if running_mean is not None or running_var is not None:
            # statistics to buffers first, so the updates and the output share them rather
            # than each reduction being fused (and recomputed) into every consumer
            realize(mean, var)
            unbiased = var.detach() * (count / (count - 1))
            for stat, new in ((running_mean, mean.detach()), (running_var, unbiased)):
                if stat is not None:
                    stat.assign(stat * (1 - momentum) + new.reshape(c) * momentum)
        xf = input.float()
        affine = tuple(t for t in (weight, bias) if t is not None)
        if is_grad_enabled() and (xf.requires_grad or any(t.requires_grad for t in affine)):
            # the gradient by batch norm's own rule (``batch_norm_grad``): two sums and one
            # elementwise pass; the chain of the mean's and variance's rules summed four
            # tensors of the input's size and stored its centred copy twice (ResNet-50's
            # backward read about 3x the bytes of the rule's)
            # (the rule takes the variance, stored, and computes 1 / sqrt(var + eps) again in
            # its kernels: built on the forward's, which a kernel has computed, the backward
            # pass stored it by a kernel of its own, a launch per layer)
            mean, var = mean.detach(), var.detach()
            arg = (mean, var, eps, axes, weight is not None, bias is not None)
            out = xf._custom("batch_norm", affine, arg,
                             lambda: _normalized(xf, mean, (var + eps).rsqrt(), weight, bias,
                                                 view))
            return out.cast(input.dtype)
    else:
        if running_mean is None or running_var is None:
            raise ValueError("batch_norm needs running_mean and running_var when not training")
        mean = running_mean.float().reshape(view)
        var = running_var.float().reshape(view)
    return _normalized(input.float(), mean, (var + eps).rsqrt(), weight, bias,
                       view).cast(input.dtype)


def _normalized(x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor | None,
                bias: Tensor | None, view: tuple[int, ...]) -> Tensor:
    """``(x - mean) * rstd``, scaled by ``weight`` and shifted by ``bias`` where given."""
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight.reshape(view)
    if bias is not None:
        out = out + bias.reshape(view)
    return out


def batch_norm_grad(out: Tensor, parents: tuple[Tensor, ...], arg: Any, g: Tensor
                    ) -> tuple[Tensor | None, ...]:
    """The gradients of training-mode ``batch_norm`` (input, then weight and bias where given),
    by the closed form: with x^ = (x - mean) * rstd over n elements a channel, dbias = sum(g),
    dweight = sum(g * x^), dx = weight * rstd * (g - dbias / n - x^ * dweight / n)."""
    mean, var, eps, axes, has_weight, has_bias = arg
    rstd = (var + eps).rsqrt()
    x = parents[0]
    weight = parents[1] if has_weight else None
    view = mean.shape
    n = x.numel() // mean.numel()
    xhat = (x - mean) * rstd
    gb = g.sum(axes, keepdim=True)
    gw = (g * xhat).sum(axes, keepdim=True)
    dx = None
    if x.requires_grad:
        scale = rstd if weight is None else rstd * weight.reshape(view)
        dx = (g - gb * (1 / n) - xhat * (gw * (1 / n))) * scale
    grads: list[Tensor | None] = [dx]
    if has_weight:
        grads.append(gw.reshape(parents[1].shape))
    if has_bias:
        grads.append(gb.reshape(parents[-1].shape))
    return tuple(grads)


def layer_norm(input: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    (input,) = amp.widen(input)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if input.shape[input.ndim - len(shape):] != shape:
        raise ValueError(f"layer_norm: input {input.shape} does not end with {shape}")
    axes = tuple(range(input.ndim - len(shape), input.ndim))
    mean, var = _moments(input, axes)
    out = (input.float() - mean) * (var + eps).rsqrt()
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.cast(input.dtype)


_EPS = {"float32": 1.1920928955078125e-07, "float16": 0.0009765625, "bfloat16": 0.0078125}


def rms_norm(input: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
             eps: float | None = None) -> Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight``; ``eps`` defaults to the dtype's machine
    epsilon, as in PyTorch."""
    (input,) = amp.widen(input)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if input.shape[input.ndim - len(shape):] != shape:
        raise ValueError(f"rms_norm: input {input.shape} does not end with {shape}")
    if eps is None:
        eps = _EPS.get(input.dtype.name, _EPS["float32"])
    axes = tuple(range(input.ndim - len(shape), input.ndim))
    xf = input.float()
    out = xf * ((xf * xf).mean(axes, keepdim=True) + eps).rsqrt()
    if weight is not None:
        out = out * weight
    return out.cast(input.dtype)


def group_norm(input: Tensor, num_groups: int, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Normalize each sample over groups of ``C / num_groups`` channels (and all other axes)."""
    (input,) = amp.widen(input)
    if input.ndim < 2 or input.shape[1] % num_groups:
        raise ValueError(f"group_norm: {num_groups} groups do not divide the channels of "
                         f"{input.shape}")
    n, c = input.shape[:2]
    x = input.reshape(n, num_groups, -1)
    mean, var = _moments(x, (2,))
    out = ((x.float() - mean) * (var + eps).rsqrt()).reshape(input.shape)
    view = (1, c) + (1,) * (input.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(view)
    if bias is not None:
        out = out + bias.reshape(view)
    return out.cast(input.dtype)


# ---- embedding, dropout ------------------------------------------------------------------------
def embedding(input: Tensor, weight: Tensor, padding_idx: int | None = None,
              max_norm: float | None = None, norm_type: float = 2.0,
              scale_grad_by_freq: bool = False, sparse: bool = False) -> Tensor:
    """Rows of ``weight`` picked by the integer ``input``; the ``padding_idx`` row gets no
    gradient."""
    if max_norm is not None or scale_grad_by_freq:
        raise NotImplementedError("embedding: max_norm and scale_grad_by_freq are not supported")
    if not isinstance(input, Tensor):
        input = Tensor(input, device=weight.device)
    if input.dtype.is_float or input.dtype.is_bool:
        raise TypeError(f"embedding indices must be integers, got {input.dtype.name}")
    out = weight.index_select(0, input.reshape(-1)).reshape(input.shape + (weight.shape[1],))
    if padding_idx is not None:
        if padding_idx < 0:
            padding_idx += weight.shape[0]
        # same values; the detached branch keeps gradients away from the padding row
        out = input.eq(padding_idx).unsqueeze(-1)._select(out.detach(), out)
    return out


def one_hot(tensor: Tensor, num_classes: int = -1) -> Tensor:
    """int64 (..., num_classes), 1 where the last index equals the class in ``tensor``
    (int64). ``num_classes=-1`` reads the largest class back from the device (and checks that
    none is negative); a given ``num_classes`` reads nothing, and a class outside it gives a
    row of zeros where PyTorch on the processor raises.

    >>> import anygpu as ag
    >>> from anygpu.nn import functional as F
    >>> F.one_hot(ag.tensor([0, 2]), 3).tolist()
    [[1, 0, 0], [0, 0, 1]]
    """
    if tensor.dtype != dt.int64:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if tensor.numel() == 0 and num_classes <= 0:
        raise RuntimeError("Can not infer total number of classes from empty tensor.")
    if num_classes == -1:
        low, high = stack([tensor.min(), tensor.max()]).tolist()
        if low < 0:
            raise RuntimeError("Class values must be non-negative.")
        num_classes = int(high) + 1
    elif num_classes < 1 and tensor.numel():  # every class is out of range: PyTorch raises
        raise RuntimeError("Class values must be smaller than num_classes.")
    classes = arange(num_classes, device=tensor.device, dtype=dt.int64)
    return tensor.unsqueeze(-1).eq(classes).cast(dt.int64)


def dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
            ) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return input * 0
    keep = rand(input.shape, device=input.device).ge(p)
    return keep._select(input * (1.0 / (1.0 - p)), input._const_like(0))


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None) -> Tensor:
    """``softmax(query @ key^T * scale + mask) @ value`` over (..., L, E), (..., S, E) and
    (..., S, Ev), batch and head axes broadcasting. A bool ``attn_mask`` marks the pairs that
    take part (True) and a float one is added to the scores; ``is_causal`` lets query ``i``
    see keys ``0..i``. ``dropout_p`` applies whenever it is above 0, as in PyTorch (layers
    pass 0 in eval mode).

    >>> import anygpu as ag
    >>> from anygpu.nn import functional as F
    >>> q, k, v = ag.randn(2, 4, 5, 8), ag.randn(2, 4, 6, 8), ag.randn(2, 4, 6, 3)
    >>> F.scaled_dot_product_attention(q, k, v, is_causal=True).shape
    (2, 4, 5, 3)
    """
    if is_causal and attn_mask is not None:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set "
                           "when is_causal=True")
    length, source = query.shape[-2], key.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    scores = query.matmul(key.transpose(-2, -1)) * scale
    if is_causal:
        rows = arange(length, device=query.device).reshape(length, 1)
        attn_mask = rows >= arange(source, device=query.device).reshape(1, source)
    if attn_mask is not None:
        if attn_mask.dtype.is_bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask
    weights = scores.softmax(-1)
    if dropout_p > 0.0:
        weights = dropout(weights, dropout_p, True)
    return weights.matmul(value)


# ---- losses --------------------------------------------------------------------------------------
def _reduce(loss: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.mean()
    raise ValueError(f"{reduction} is not a valid value for reduction")


def _legacy(size_average: bool | None, reduce: bool | None, reduction: str) -> str:
    if size_average is None and reduce is None:
        return reduction
    if reduce is False:
        return "none"
    return "sum" if size_average is False else "mean"


def nll_loss(input: Tensor, target: Tensor, weight: Tensor | None = None,
             size_average: bool | None = None, ignore_index: int = -100,
             reduce: bool | None = None, reduction: str = "mean") -> Tensor:
    """``-input[n, target[n]] * weight[target[n]]``; 'mean' divides by the summed weights of
    the targets that are not ``ignore_index``."""
    reduction = _legacy(size_average, reduce, reduction)
    if input.ndim == 1:  # unbatched (C,) with a scalar target
        out = nll_loss(input.unsqueeze(0), target.reshape(1), weight, None, ignore_index, None,
                       reduction)
        return out.reshape(()) if reduction == "none" else out
    if input.ndim < 2 or target.shape != input.shape[:1] + input.shape[2:]:
        raise ValueError(f"nll_loss: target {target.shape} does not fit input {input.shape}")
    if target.dtype.is_float or target.dtype.is_bool:
        raise TypeError(f"nll_loss: target must hold class indices, got {target.dtype.name}")
    keep = target.ne(ignore_index)
    safe = keep._select(target, 0)
    loss = -input.gather(1, safe.unsqueeze(1)).squeeze(1)
    if weight is None:
        loss = keep._select(loss, 0.0)
        return loss.sum() / keep.sum().cast(loss.dtype) if reduction == "mean" \
            else _reduce(loss, reduction)
    w = keep._select(weight.gather(0, safe.reshape(-1)).reshape(safe.shape).cast(loss.dtype), 0.0)
    loss = keep._select(loss * w, 0.0)
    return loss.sum() / w.sum() if reduction == "mean" else _reduce(loss, reduction)


def cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None,
                  size_average: bool | None = None, ignore_index: int = -100,
                  reduce: bool | None = None, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
    """``log_softmax`` over the class axis (1, or 0 for an unbatched input) then the negative
    log likelihood of class-index targets, or of class probabilities when ``target`` is a
    float tensor of the input's shape; PyTorch's weighting and label smoothing."""
    reduction = _legacy(size_average, reduce, reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
    cdim = 0 if input.ndim == 1 else 1
    n_classes = input.shape[cdim]
    logp = input.log_softmax(cdim)
    view = [1] * input.ndim
    view[cdim] = n_classes
    wv = weight.reshape(view).cast(logp.dtype) if weight is not None else None
    if target.dtype.is_float and target.shape == input.shape:
        t = target.cast(logp.dtype)
        if label_smoothing > 0:
            t = t * (1 - label_smoothing) + label_smoothing / n_classes
        terms = logp * t if wv is None else logp * t * wv
        if reduction == "mean":
            return -terms.sum() / (input.numel() // n_classes)
        return _reduce(-terms.sum(cdim), reduction)
    nll = nll_loss(logp, target, weight, None, ignore_index, None, reduction)
    if label_smoothing == 0:
        return nll
    keep = target.ne(ignore_index)
    smooth = -(logp if wv is None else logp * wv).sum(cdim)
    smooth = keep._select(smooth, 0.0)
    if reduction == "mean":
        if weight is not None:
            safe = keep._select(target, 0)
            tw = weight.gather(0, safe.reshape(-1)).reshape(safe.shape).cast(logp.dtype)
            smooth = smooth.sum() / keep._select(tw, 0.0).sum()
        else:
            smooth = smooth.sum() / keep.sum().cast(logp.dtype)
    else:
        smooth = _reduce(smooth, reduction)
    return (1 - label_smoothing) * nll + smooth * (label_smoothing / n_classes)


def _weighted(loss: Tensor, weight: Tensor | None, reduction: str) -> Tensor:
    if weight is None:
        return _reduce(loss, reduction)
    if weight.shape != loss.shape:
        raise ValueError("Weights and input must have the same size.")
    loss = loss * weight
    return loss.sum() / weight.sum() if reduction == "mean" else _reduce(loss, reduction)


def mse_loss(input: Tensor, target: Tensor, size_average: bool | None = None,
             reduce: bool | None = None, reduction: str = "mean",
             weight: Tensor | None = None) -> Tensor:
    input, target = amp.widen(input, target)
    diff = input - target
    return _weighted(diff * diff, weight, _legacy(size_average, reduce, reduction))


def l1_loss(input: Tensor, target: Tensor, size_average: bool | None = None,
            reduce: bool | None = None, reduction: str = "mean",
            weight: Tensor | None = None) -> Tensor:
    input, target = amp.widen(input, target)
    return _weighted((input - target).abs(), weight, _legacy(size_average, reduce, reduction))


def binary_cross_entropy_with_logits(input: Tensor, target: Tensor, weight: Tensor | None = None,
                                     size_average: bool | None = None, reduce: bool | None = None,
                                     reduction: str = "mean", pos_weight: Tensor | None = None
                                     ) -> Tensor:
    """Sigmoid and binary cross entropy in one stable expression:
    ``(1 - t) * x + (1 + (pos_weight - 1) * t) * softplus(-x)``."""
    input, target = amp.widen(input, target)
    reduction = _legacy(size_average, reduce, reduction)
    if target.shape != input.shape:
        raise ValueError(f"Target size ({target.shape}) must be the same as input size "
                         f"({input.shape})")
    x, t = input, target.cast(input.dtype)
    softplus_neg = (-x).maximum(0) + (-x.abs()).exp().log1p()
    if pos_weight is not None:
        loss = (1 - t) * x + ((pos_weight - 1) * t + 1) * softplus_neg
    else:
        loss = (1 - t) * x + softplus_neg
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


__all__ = ["conv2d", "conv_transpose2d", "linear", "relu", "gelu", "silu", "sigmoid", "tanh",
           "leaky_relu", "softmax", "log_softmax", "pad", "unfold2d", "where", "max_pool2d",
           "avg_pool2d", "adaptive_avg_pool2d", "batch_norm", "layer_norm", "rms_norm",
           "group_norm", "embedding", "dropout", "cross_entropy", "nll_loss", "mse_loss",
           "l1_loss", "binary_cross_entropy_with_logits", "conv1d", "conv_transpose1d", "prelu",
           "one_hot", "interpolate", "normalize", "cosine_similarity", "pairwise_distance",
           "hardtanh", "relu6", "winograd_3x3"]
