"""safetensors files: ``save_file``/``load_file`` for dicts of tensors, ``save``/``load`` for a
Module's state_dict.

The format is small enough to read and write directly: an 8-byte little-endian header length, a
JSON header ``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}`` padded with
spaces to a multiple of 8 bytes, then the tensors' raw little-endian bytes. bfloat16 tensors are
stored as BF16 bits and come back as bfloat16, so files interoperate with PyTorch and Hugging
Face (``safetensors.torch``) in both directions.

>>> import os, tempfile
>>> import anygpu as ag
>>> from anygpu.nn import state
>>> path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
>>> state.save_file({"w": ag.ones(2, 3, dtype=ag.bfloat16)}, path)
>>> t = state.load_file(path)["w"]
>>> t.shape, t.dtype
((2, 3), anygpu.bfloat16)
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import numpy as np

from anygpu import dtype as dt
from anygpu.tensor import Tensor

# safetensors dtype name -> (NumPy storage dtype, anygpu dtype it loads as)
_FORMATS: dict[str, tuple[Any, dt.DType]] = {
    "BOOL": (np.bool_, dt.bool_), "U8": (np.uint8, dt.uint8), "I8": (np.int8, dt.int8),
    "I16": (np.int16, dt.int32), "U16": (np.uint16, dt.int32), "I32": (np.int32, dt.int32),
    "U32": (np.uint32, dt.int64), "I64": (np.int64, dt.int64), "U64": (np.uint64, dt.int64),
    "F16": (np.float16, dt.float16), "BF16": (np.uint16, dt.bfloat16),
    "F32": (np.float32, dt.float32), "F64": (np.float64, dt.float32),
}
_NUMPY_NAMES = {np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8",
                np.dtype(np.int16): "I16", np.dtype(np.uint16): "U16", np.dtype(np.int32): "I32",
                np.dtype(np.uint32): "U32", np.dtype(np.int64): "I64", np.dtype(np.uint64): "U64",
                np.dtype(np.float16): "F16", np.dtype(np.float32): "F32",
                np.dtype(np.float64): "F64"}


def _to_bytes(value: Any) -> tuple[str, np.ndarray]:
    """(safetensors dtype, C-ordered host array of the stored values) of a tensor or array."""
    if isinstance(value, Tensor):
        host = value.numpy()
        if value.dtype == dt.bfloat16:  # float32 values that are exact bfloat16s: keep top bits
            bits = np.asarray(host, dtype=np.float32).view(np.uint32) >> 16
            return "BF16", bits.astype("<u2", order="C")
        value = host
    elif hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = Tensor(value)
        return _to_bytes(value)
    arr = np.asarray(value)
    name = _NUMPY_NAMES.get(arr.dtype)
    if name is None:
        raise TypeError(f"cannot store an array of dtype {arr.dtype} in safetensors")
    return name, arr.astype(arr.dtype.newbyteorder("<"), order="C", copy=False)


def save_file(tensors: Mapping[str, Any], filename: str | os.PathLike,
              metadata: Mapping[str, str] | None = None) -> None:
    """Write anygpu Tensors (or NumPy arrays, torch tensors) to a safetensors file."""
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must map str to str")
        header["__metadata__"] = dict(metadata)
    blobs = []
    offset = 0
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be strings, got {name!r}")
        kind, arr = _to_bytes(value)
        data = arr.tobytes()
        header[name] = {"dtype": kind, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(filename, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for data in blobs:
            f.write(data)


def _read(filename: str | os.PathLike) -> tuple[dict[str, tuple[np.ndarray, dt.DType]],
                                                dict[str, str]]:
    """{name: (host array, anygpu dtype)} and the metadata; bfloat16 reads as float32 values."""
    raw = np.memmap(filename, dtype=np.uint8, mode="r") if os.path.getsize(filename) else \
        np.zeros(0, np.uint8)
    if raw.size < 8:
        raise ValueError(f"{filename}: not a safetensors file (too short)")
    size = int.from_bytes(raw[:8].tobytes(), "little")
    if size > raw.size - 8:
        raise ValueError(f"{filename}: header length {size} runs past the end of the file")
    try:
        header = json.loads(raw[8:8 + size].tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{filename}: the safetensors header is not valid JSON") from err
    metadata = header.pop("__metadata__", None) or {}
    data = raw[8 + size:]
    out: dict[str, tuple[np.ndarray, dt.DType]] = {}
    for name, info in header.items():
        kind = info.get("dtype")
        if kind not in _FORMATS:
            raise ValueError(f"{filename}: tensor {name!r} has unsupported dtype {kind!r}")
        store, target = _FORMATS[kind]
        shape = tuple(int(s) for s in info["shape"])
        start, end = (int(v) for v in info["data_offsets"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(store).itemsize
        if not 0 <= start <= end <= data.size or end - start != nbytes:
            raise ValueError(f"{filename}: tensor {name!r} has bad data offsets {[start, end]} "
                             f"for shape {list(shape)} and dtype {kind}")
        arr = np.frombuffer(data[start:end].tobytes(), dtype=np.dtype(store).newbyteorder("<"))
        arr = arr.reshape(shape)
        if kind == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = (arr, target)
    return out, metadata


def load_file(filename: str | os.PathLike, device: str | None = None) -> dict[str, Tensor]:
    """The tensors of a safetensors file, on ``device``. Types anygpu lacks load as the nearest
    one it has (F64 as float32, I16/U16 as int32, U32/U64 as int64)."""
    arrays, _ = _read(filename)
    return {name: Tensor(arr, device=device, dtype=d) for name, (arr, d) in arrays.items()}


def load_metadata(filename: str | os.PathLike) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file ({} if it has none)."""
    return _read(filename)[1]


def save(module: Any, filename: str | os.PathLike,
         metadata: Mapping[str, str] | None = None) -> None:
    """Write ``module.state_dict()`` to a safetensors file.

    >>> import os, tempfile
    >>> from anygpu import nn
    >>> m = nn.Linear(3, 2)
    >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> save(m, path)
    >>> load(nn.Linear(3, 2), path)
    <All keys matched successfully>
    """
    save_file(module.state_dict(), filename, metadata)


def load(module: Any, filename: str | os.PathLike, strict: bool = True) -> Any:
    """Load a safetensors file into ``module`` with ``load_state_dict`` (values go straight to
    each parameter's device and dtype)."""
    arrays, _ = _read(filename)
    return module.load_state_dict({k: a for k, (a, _) in arrays.items()}, strict=strict)


__all__ = ["save_file", "load_file", "load_metadata", "save", "load"]
