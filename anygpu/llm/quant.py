"""Quantized weights of the linear projections: packed on the host with NumPy, dequantized on the
device by anygpu Tensor operations that the scheduler fuses into the kernel that reads them.

Formats (``QuantizedWeight.kind``), each an ``(out, in)`` matrix cut along ``in`` into groups:

- ``q8``: int8 values and one float16 scale per ``group`` (32 or 128) values, symmetric:
  ``w = q * scale``, ``scale = max|w| / 127``. With group 32 its bytes are GGUF's Q8_0.
- ``q4``: 4-bit values, two per byte, and one float16 scale per group: ``w = (n - 8) * scale``,
  ``n`` in 0..15. Within a group of ``g`` values, byte ``j`` holds value ``j`` in its low
  nibble and value ``j + g/2`` in its high one; with group 32 its bytes are GGUF's Q4_0. As
  llama.cpp does, the scale puts the value of largest magnitude on -8 (``scale = -m / 8``, where
  ``m`` is that value, signed), so the whole range -8..7 is used.
- ``q4_k``: GGUF's Q4_K carried as it is: super-blocks of 256 values, 4-bit values (bytes of
  64 values: low nibbles the first 32, high nibbles the next 32), per 32 values a 6-bit scale and
  a 6-bit min (unpacked to a byte each at load), per super-block float16 ``d`` and ``dmin``:
  ``w = d * scale * n - dmin * min``.
- ``q6_k``: GGUF's Q6_K carried as it is: super-blocks of 256 values of 6 bits (the low 4 bits
  in ``ql``, the high 2 in ``qh``, in llama.cpp's order), an int8 scale per 16 values and a
  float16 ``d`` per super-block: ``w = d * scale * (q - 32)``.

Packed bytes live on the device as int32 words (four bytes each, the same memory), so every
backend reads them at their size (WebGPU has no 8-bit storage); the dequantization takes them
apart with shifts and masks. Scales are float16 where the device has float16, else float32
(their values are float16's either way).

>>> import numpy as np
>>> w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
>>> qw = quantize(w, "q8", group_size=32, device="cpu")
>>> back = qw.dequantize().numpy()
>>> bool(np.abs(back - w).max() <= np.abs(w).max() / 127)
True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from anygpu import dtype as dt
from anygpu.nn import functional as F
from anygpu.runtime.registry import get_device
from anygpu.tensor import Tensor, arange

QUANTS = ("q8", "q4")  # the formats ``anygpu.llm.load(quant=...)`` makes from float weights
GROUP_SIZES = (32, 128)
SUPER = 256  # values per super-block of the K formats


def check_quant(quant: str | None, group_size: int) -> None:
    """Raise ValueError for a format or group size ``load`` does not make."""
    if quant is not None and quant not in QUANTS:
        raise ValueError(f"quant must be None, 'q8' or 'q4', got {quant!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be 32 or 128, got {group_size!r}")


class QuantizedWeight:
    """An ``(out, in)`` weight in one of the formats above: device tensors (``parts``) and the
    dtype it is dequantized to. ``linear(x, bias)`` is ``F.linear`` over ``dequantize()``, which
    builds the dequantization anew on each call, so it fuses into the product that reads it
    instead of being stored."""

    def __init__(self, kind: str, shape: tuple[int, int], parts: dict[str, Tensor],
                 dtype: dt.DType, group: int) -> None:
        self.kind, self.shape, self.parts, self.dtype, self.group = kind, shape, parts, dtype, group

    @property
    def nbytes(self) -> int:
        """Bytes the parts take on a device that stores them at their size."""
        return sum(int(np.prod(t.shape)) * t.dtype.itemsize for t in self.parts.values())

    def dequantize(self) -> Tensor:
        """The weight as a lazy ``(out, in)`` tensor of ``dtype``."""
        values = _DEQUANTIZE[self.kind](self)
        return values if self.dtype == dt.float32 else values.cast(self.dtype)

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        return F.linear(x, self.dequantize(), bias)

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.kind}, {self.shape}, group {self.group})"


# ---- the device side: fields of int32 words, as Tensor ops ----------------------------------
def _iota(n: int, device: str) -> Tensor:
    return arange(n, dtype=dt.int32, device=device)


def _bytes(words: Tensor) -> Tensor:
    """(..., n) int32 words -> (..., 4 n) their bytes, low byte first, as int32 0..255."""
    *lead, n = words.shape
    shifts = _iota(4, words.device) * 8
    parts = words.reshape(*lead, n, 1).expand(*lead, n, 4) >> shifts
    return (parts & 255).reshape(*lead, 4 * n)


def _scale(scale: Tensor, per: int) -> Tensor:
    """(out, G) -> (out, G * per) float32: each scale repeated over its ``per`` values."""
    rows, groups = scale.shape
    return scale.cast(dt.float32).reshape(rows, groups, 1).expand(rows, groups, per) \
        .reshape(rows, groups * per)


def _q8(w: QuantizedWeight) -> Tensor:
    rows, cols = w.shape
    words = w.parts["values"]  # (rows, cols / 4)
    shifts = _iota(4, words.device) * 8
    # the low byte of each shifted word, read as a signed byte
    q = (words.reshape(rows, cols // 4, 1).expand(rows, cols // 4, 4) >> shifts).cast(dt.int8)
    return q.reshape(rows, cols).cast(dt.float32) * _scale(w.parts["scales"], w.group)


def _nibbles(words: Tensor, span: int) -> Tensor:
    """(rows, W) int32 words of 4-bit values laid out in runs of ``span`` values (``span / 2``
    bytes: value ``j`` in byte ``j``'s low nibble, value ``j + span / 2`` in its high one)
    -> (rows, 8 W) the values 0..15 in order."""
    rows, n = words.shape
    runs, per = n * 8 // span, span // 8  # words per run
    # value (run, half, word, byte) sits at shift 4 * half + 8 * byte of its word
    shifts = (_iota(2, words.device) * 4).reshape(2, 1, 1) + \
        (_iota(4, words.device) * 8).reshape(1, 1, 4)
    parts = words.reshape(rows, runs, 1, per, 1).expand(rows, runs, 2, per, 4) >> shifts
    return (parts & 15).reshape(rows, n * 8)


def _q4(w: QuantizedWeight) -> Tensor:
    n = _nibbles(w.parts["values"], w.group)
    return (n - 8).cast(dt.float32) * _scale(w.parts["scales"], w.group)


def _q4_k(w: QuantizedWeight) -> Tensor:
    rows, cols = w.shape
    supers = cols // SUPER
    n = _nibbles(w.parts["values"], 64).cast(dt.float32)
    d = w.parts["d"].cast(dt.float32).reshape(rows, supers, 2, 1)  # d and dmin
    small = _bytes(w.parts["scales"]).reshape(rows, supers, 2, 8).cast(dt.float32)
    per_block = d * small  # (rows, supers, 2, 8): the scales, then the mins, of 32 values
    scale = _scale(per_block[:, :, 0].reshape(rows, supers * 8), 32)
    low = _scale(per_block[:, :, 1].reshape(rows, supers * 8), 32)
    return n * scale - low


def _q6_k(w: QuantizedWeight) -> Tensor:
    rows, cols = w.shape
    supers = cols // SUPER
    dev = w.parts["ql"].device
    # a super-block is two halves of 128 values; value (half, hi, lo, word, byte) takes its low
    # 4 bits from ql byte (lo, word, byte) at shift 4 hi, its high 2 bits from qh byte
    # (word, byte) at shift 2 (2 hi + lo)
    shape = (rows, supers, 2, 2, 2, 8, 4)
    hi = _iota(2, dev).reshape(2, 1, 1, 1)
    lo = _iota(2, dev).reshape(1, 2, 1, 1)
    byte = _iota(4, dev) * 8
    ql = w.parts["ql"].reshape(rows, supers, 2, 1, 2, 8, 1).expand(*shape) >> (hi * 4 + byte)
    qh = w.parts["qh"].reshape(rows, supers, 2, 1, 1, 8, 1).expand(*shape) >> \
        ((hi * 2 + lo) * 2 + byte)
    q = ((ql & 15) | ((qh & 3) << 4)) - 32
    scales = _bytes(w.parts["scales"]).cast(dt.int8).cast(dt.float32)  # (rows, supers * 16)
    d = w.parts["d"].cast(dt.float32).reshape(rows, supers, 1).expand(rows, supers, 16)
    per16 = scales * d.reshape(rows, supers * 16)
    return q.reshape(rows, cols).cast(dt.float32) * _scale(per16, 16)


_DEQUANTIZE = {"q8": _q8, "q4": _q4, "q4_k": _q4_k, "q6_k": _q6_k}


# ---- the host side: NumPy packing ------------------------------------------------------------
def _words(raw: np.ndarray) -> np.ndarray:
    """(rows, n bytes) -> (rows, n / 4) int32: the same memory as words."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    return raw.view(np.int32)


def _scale_dtype(device: Any) -> dt.DType:
    return dt.float16 if device.supports(dt.float16) else dt.float32


def _upload(kind: str, shape: tuple[int, int], group: int, device: str | None,
            dtype: dt.DType, words: dict[str, np.ndarray], halves: dict[str, np.ndarray]
            ) -> QuantizedWeight:
    dev = get_device(device)
    scale_dtype = _scale_dtype(dev)
    parts = {k: Tensor(_words(v), device=dev.name, dtype=dt.int32) for k, v in words.items()}
    for k, v in halves.items():
        parts[k] = Tensor(np.ascontiguousarray(v, dtype=np.float16).astype(scale_dtype.np),
                          device=dev.name, dtype=scale_dtype)
    for t in parts.values():
        t.realize()
    return QuantizedWeight(kind, shape, parts, dtype, group)


def pack_q8(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(out, in) floats -> (int8 values (out, in), float16 scales (out, in / group))."""
    rows, cols = w.shape
    blocks = np.asarray(w, dtype=np.float32).reshape(rows, cols // group, group)
    scale = (np.abs(blocks).max(axis=2) / 127).astype(np.float16)
    s = scale.astype(np.float32)[:, :, None]
    inv = np.divide(1.0, s, out=np.zeros_like(s), where=s != 0)
    q = np.clip(np.rint(blocks * inv), -127, 127).astype(np.int8)
    return q.reshape(rows, cols), scale


def pack_q4(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(out, in) floats -> (packed bytes (out, in / 2), float16 scales (out, in / group))."""
    rows, cols = w.shape
    blocks = np.asarray(w, dtype=np.float32).reshape(rows, cols // group, group)
    at = np.abs(blocks).argmax(axis=2)[:, :, None]
    extreme = np.take_along_axis(blocks, at, axis=2)  # signed
    scale = (extreme / -8).astype(np.float16)
    s = scale.astype(np.float32)
    inv = np.divide(1.0, s, out=np.zeros_like(s), where=s != 0)
    n = (np.clip(np.rint(blocks * inv), -8, 7) + 8).astype(np.uint8)
    half = group // 2
    packed = n[:, :, :half] | (n[:, :, half:] << 4)
    return packed.reshape(rows, cols // 2), scale[:, :, 0]


def quantize(w: np.ndarray, kind: str, group_size: int = 32, device: str | None = None,
             dtype: Any = dt.float32) -> QuantizedWeight:
    """A float ``(out, in)`` host array (float32, float16, or bfloat16 values as float32) as a
    ``q8`` or ``q4`` weight on ``device``, dequantized to ``dtype``."""
    check_quant(kind, group_size)
    rows, cols = w.shape
    if cols % group_size:
        raise ValueError(f"a weight of {cols} inputs does not split into groups of "
                         f"{group_size}")
    if kind == "q8":
        q, scale = pack_q8(w, group_size)
        values = q.view(np.uint8)
    else:
        values, scale = pack_q4(w, group_size)
    return _upload(kind, (rows, cols), group_size, device, dtype, {"values": values},
                   {"scales": scale})


# ---- GGUF blocks -----------------------------------------------------------------------------
# bytes per block and values per block of the GGUF formats carried here
BLOCKS = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_K": (144, SUPER), "Q6_K": (210, SUPER)}


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes per super-block -> its eight 6-bit scales and eight 6-bit mins: the
    first four of each in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins), the last four
    in bytes 8-11 (low nibble: scale, high: min) with their top 2 bits in the top bits of
    bytes 0-3 (scales) and 4-7 (mins)."""
    q = packed.astype(np.uint8)
    first_s, first_m = q[..., 0:4] & 63, q[..., 4:8] & 63
    last_s = (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)
    last_m = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return (np.concatenate([first_s, last_s], axis=-1),
            np.concatenate([first_m, last_m], axis=-1))


def from_blocks(fmt: str, raw: np.ndarray, shape: tuple[int, int], device: str | None = None,
                dtype: Any = dt.float32) -> QuantizedWeight:
    """A GGUF tensor's blocks (``raw``: (out, bytes per row) uint8, rows of ``shape[1]``
    values) as a weight on ``device``: Q8_0 and Q4_0 become ``q8`` and ``q4`` of group 32
    (their bytes and scales rearranged, not requantized), Q4_K and Q6_K keep their formats."""
    rows, cols = shape
    size, per = BLOCKS[fmt]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // per, size)
    if fmt == "Q8_0":
        scale = blocks[:, :, :2].copy().view(np.float16)[:, :, 0]
        return _upload("q8", shape, 32, device, dtype,
                       {"values": blocks[:, :, 2:].reshape(rows, cols)}, {"scales": scale})
    if fmt == "Q4_0":
        scale = blocks[:, :, :2].copy().view(np.float16)[:, :, 0]
        return _upload("q4", shape, 32, device, dtype,
                       {"values": blocks[:, :, 2:].reshape(rows, cols // 2)}, {"scales": scale})
    if fmt == "Q4_K":
        d = blocks[:, :, :4].copy().view(np.float16)  # (rows, supers, 2): d, dmin
        scales, mins = _k_scales(blocks[:, :, 4:16])
        small = np.concatenate([scales, mins], axis=-1).reshape(rows, -1)
        return _upload("q4_k", shape, SUPER, device, dtype,
                       {"values": blocks[:, :, 16:].reshape(rows, -1), "scales": small},
                       {"d": d})
    if fmt == "Q6_K":
        d = blocks[:, :, 208:210].copy().view(np.float16)[:, :, 0]
        return _upload("q6_k", shape, SUPER, device, dtype,
                       {"ql": blocks[:, :, :128].reshape(rows, -1),
                        "qh": blocks[:, :, 128:192].reshape(rows, -1),
                        "scales": blocks[:, :, 192:208].reshape(rows, -1)}, {"d": d})
    raise ValueError(f"no block format {fmt!r} (carried: {', '.join(BLOCKS)})")


def permute_rows(raw: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of a query or key projection's rows (``heads`` heads; a
    weight, its blocks, or a bias). Its converter writes, per head, the rows of Hugging Face's
    two halves interleaved (row ``2 i`` from the first half's row ``i``, row ``2 i + 1`` from
    the second half's), so that its RoPE rotates adjacent pairs; read back, the rows of each
    head go back to the two halves."""
    rows = raw.shape[0]
    per = rows // heads
    return raw.reshape(heads, per // 2, 2, *raw.shape[1:]).swapaxes(1, 2).reshape(raw.shape)
