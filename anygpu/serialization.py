"""Checkpoints as PyTorch writes them: ``save(obj, f)`` and ``load(f)`` of any picklable structure
holding Tensors (a state_dict, a dict with the model's and the optimizer's state and the epoch),
and ``load`` of files written by ``torch.save``.

A file holds a pickle stream (protocol 5) whose tensors' bytes follow it as out-of-band buffers,
framed so that a foreign, truncated or damaged file is recognized before anything is unpickled::

    b"\\x93AGCKPT\\x00"                    magic
    <u32 version> <u64 pickle length> <u64 buffer count> <u64 length of each buffer>
    the pickle stream, then the buffers
    <u32 CRC-32 of the stream and the buffers> b"AGEND\\x00\\x00\\x00"

A tensor pickles by value: dtype name, shape, little-endian bytes (bfloat16 as its raw bits),
device string and ``requires_grad``; it unpickles onto its device, or where ``map_location``
sends it. ``weights_only=True`` (the default, as in PyTorch 2.6+) unpickles through an
allow-list of tensors, containers, numbers, strings and NumPy arrays, so that a file cannot run
code; ``add_safe_globals`` extends the list.

>>> import io
>>> import anygpu as ag
>>> f = io.BytesIO()
>>> ag.save({"w": ag.tensor([1.0, 2.0]), "epoch": 3}, f)
>>> _ = f.seek(0)
>>> ag.load(f)
{'w': tensor([1., 2.]), 'epoch': 3}
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import copyreg
import io
import math
import os
import pickle
import struct
import zlib
from typing import IO, Any, Callable, Iterable, Iterator, Mapping, Union

import numpy as np

from anygpu import dtype as dt
from anygpu.dtype import DType
from anygpu.graph import schedule as sched
from anygpu.graph.lazy import Lazy
from anygpu.runtime.base import Device
from anygpu.runtime.registry import BackendUnavailable, get_device, parse_device
from anygpu.tensor import Tensor

FileLike = Union[str, "os.PathLike[str]", IO[bytes]]
MapLocation = Union[str, Device, Callable[[Tensor, str], Any], Mapping[str, str], None]

MAGIC = b"\x93AGCKPT\x00"  # a first byte no text encoding starts with, as NumPy's .npy magic
END = b"AGEND\x00\x00\x00"
VERSION = 1
PROTOCOL = 5  # the first protocol with out-of-band buffers: tensor bytes are never copied into
# the pickle stream
_HEAD = struct.Struct("<8sIQQ")
_TAIL = struct.Struct("<I8s")
_CHUNK = 1 << 24
# what torch.save writes first with _use_new_zipfile_serialization=False: the pickled magic
# number 0x1950a86a20f9469cfc6c at protocol 2
_TORCH_LEGACY = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


class CheckpointError(ValueError):
    """The file is not an anygpu checkpoint, or it is truncated or damaged."""


# ---- tensors and dtypes by value ----------------------------------------------------------------
def reduce_tensor(t: Tensor, protocol: int) -> tuple[Any, ...]:
    """``Tensor.__reduce_ex__``: rebuild from (class, {dtype, shape, data, device,
    requires_grad}). The values are read to the host (a view through a contiguous copy); the
    autograd history and ``grad`` are left behind, as in PyTorch.

    >>> import pickle
    >>> import anygpu as ag
    >>> pickle.loads(pickle.dumps(ag.arange(3)))
    tensor([0, 1, 2])
    """
    host = np.asarray(t.numpy())
    if t.dtype == dt.bfloat16:  # exact bfloat16 values read as float32: keep their top 16 bits
        host = (np.asarray(host, dtype=np.float32).view(np.uint32) >> 16).astype("<u2")
    else:
        host = host.astype(np.dtype(t.dtype.np).newbyteorder("<"), copy=False)
    host = np.ascontiguousarray(host.reshape(-1))
    data: Any = pickle.PickleBuffer(host.data) if protocol >= 5 else host.tobytes()
    state = {"dtype": t.dtype.name, "shape": tuple(t.shape), "data": data, "device": t.device,
             "requires_grad": t.requires_grad}
    extra = getattr(t, "__dict__", None)  # a subclass without __slots__ keeps its attributes
    return (_rebuild_tensor, (type(t), state)) + ((extra,) if extra else ())


def _rebuild_tensor(cls: type, state: Mapping[str, Any]) -> Tensor:
    if not (isinstance(cls, type) and issubclass(cls, Tensor)):
        raise pickle.UnpicklingError(f"{cls!r} is not a Tensor class")
    dtype = dt.to_dtype(state["dtype"])
    shape = tuple(int(s) for s in state["shape"])
    store = np.dtype(np.uint16 if dtype == dt.bfloat16 else dtype.np).newbyteorder("<")
    host = np.frombuffer(state["data"], dtype=store)
    if host.size != math.prod(shape):
        raise CheckpointError(f"a {dtype.name} tensor of shape {list(shape)} has "
                              f"{host.size} values")
    host = host.astype(store.newbyteorder("="), copy=False).reshape(shape)
    lazy = _placement().place(host, dtype, str(state["device"]))
    out = cls.__new__(cls)
    Tensor.__init__(out, lazy, requires_grad=bool(state["requires_grad"]) and dtype.is_float)
    return out


def _rebuild_dtype(name: str) -> DType:
    return dt.to_dtype(name)


# dtypes pickle by name, so that they load under weights_only and come back as the singletons
copyreg.pickle(DType, lambda d: (_rebuild_dtype, (d.name,)))


def _upload(host: np.ndarray, dtype: DType, device: str) -> Lazy:
    """A realized node holding ``host`` on ``device``. bfloat16 goes up as its raw bits
    (``Tensor(...)`` would take float32 values and round them, NaN payloads lost)."""
    dev = get_device(device)
    buf = sched.alloc_for(dev, host.size, dtype)
    if host.size:
        buf.copy_in(sched.to_storage(host, dtype, dev).reshape(-1))
    return Lazy.from_buffer(buf, tuple(host.shape), dtype, dev.name)


# ---- where loaded tensors go --------------------------------------------------------------------
def _device_key(name: str) -> str:
    """"cuda" and "cuda:0" name the same device; other strings stay as they are."""
    try:
        backend, index = parse_device(name)
    except ValueError:
        return name
    return f"{backend}:{index}"


class _Placement:
    """``map_location`` of one load, applied to each tensor's saved device string."""

    def __init__(self, map_location: MapLocation = None):
        if isinstance(map_location, Device):
            map_location = map_location.name
        if isinstance(map_location, Mapping):
            map_location = {_device_key(str(k)): v for k, v in map_location.items()}
        if not (map_location is None or isinstance(map_location, (str, Mapping))
                or callable(map_location)):
            raise TypeError("map_location must be a device string, a dict of device strings or "
                            f"a callable, not {type(map_location).__name__}")
        self.map_location = map_location
        self.devices: dict[str, str] = {}

    def device(self, saved: str) -> str:
        """The available device a tensor saved on ``saved`` goes to, or a clear error."""
        if saved in self.devices:
            return self.devices[saved]
        target: Any = saved
        if isinstance(self.map_location, str):
            target = self.map_location
        elif isinstance(self.map_location, Mapping):
            target = self.map_location.get(_device_key(saved), saved)
        if isinstance(target, Device):
            target = target.name
        try:
            name = get_device(str(target)).name
        except (BackendUnavailable, ValueError) as err:
            if target == saved:
                raise BackendUnavailable(
                    f"the checkpoint holds tensors on {saved}, which is not available here "
                    f"({err}); load them elsewhere with map_location, e.g. "
                    f"anygpu.load(f, map_location='cpu')") from err
            raise BackendUnavailable(f"map_location sends tensors saved on {saved} to {target}, "
                                     f"which is not available here ({err})") from err
        self.devices[saved] = name
        return name

    def place(self, host: np.ndarray, dtype: DType, saved: str) -> Lazy:
        if not callable(self.map_location) or isinstance(self.map_location, Mapping):
            return _upload(host, dtype, self.device(saved))
        # PyTorch calls map_location(storage, location) with the data on the processor and
        # takes what it returns; None means the saved location
        on_host = Tensor(_upload(host, dtype, "cpu"))
        result = self.map_location(on_host, saved)
        if result is None:
            result = self.device(saved)
        if isinstance(result, Device):
            result = result.name
        if isinstance(result, str):
            result = on_host.to(get_device(result).name).realize()
        if not isinstance(result, Tensor):
            raise TypeError(f"map_location returned {type(result).__name__}; expected a Tensor, "
                            "a device string or None")
        return result.detach().lazy


_LOADING: contextvars.ContextVar[_Placement | None] = contextvars.ContextVar(
    "anygpu_loading", default=None)


def _placement() -> _Placement:
    """The running load's placement; a plain ``pickle.loads`` keeps the saved devices."""
    return _LOADING.get() or _Placement()


# ---- weights_only ------------------------------------------------------------------------------
_SAFE_NAMES: set[tuple[str, str]] = {
    ("anygpu.serialization", "_rebuild_tensor"), ("anygpu.serialization", "_rebuild_dtype"),
    ("anygpu.tensor", "Tensor"), ("anygpu.nn.module", "Parameter"),
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("collections", "deque"),
    ("collections", "Counter"),
    *(("builtins", n) for n in ("set", "frozenset", "slice", "range", "complex", "bytearray",
                                "bytes", "list", "dict", "tuple", "int", "float", "bool", "str")),
    # NumPy arrays and scalars (a metric, a random generator's seed): rebuilt from bytes and a
    # dtype; an array of objects unpickles its elements through this same list
    ("numpy", "ndarray"), ("numpy", "dtype"),
    *((f"numpy.{core}.multiarray", n) for core in ("core", "_core")
      for n in ("_reconstruct", "scalar")),
    *((f"numpy.{core}.numeric", "_frombuffer") for core in ("core", "_core")),
}
_user_safe: set[tuple[str, str]] = set()


def add_safe_globals(objects: Iterable[Any]) -> None:
    """Let ``load(..., weights_only=True)`` unpickle these classes or functions too (PyTorch's
    ``torch.serialization.add_safe_globals``).

    >>> import argparse
    >>> add_safe_globals([argparse.Namespace])
    """
    for obj in objects:
        _user_safe.add((obj.__module__, obj.__qualname__))


@contextlib.contextmanager
def safe_globals(objects: Iterable[Any]) -> Iterator[None]:
    """``add_safe_globals`` for the duration of a ``with`` block (PyTorch's
    ``torch.serialization.safe_globals``).

    >>> import argparse, io
    >>> import anygpu as ag
    >>> f = io.BytesIO()
    >>> ag.save({"args": argparse.Namespace(lr=0.1)}, f)
    >>> _ = f.seek(0)
    >>> with safe_globals([argparse.Namespace]):
    ...     ag.load(f)["args"].lr
    0.1
    """
    added = {(obj.__module__, obj.__qualname__) for obj in objects} - _user_safe
    _user_safe.update(added)
    try:
        yield
    finally:
        _user_safe.difference_update(added)


class _WeightsOnlyUnpickler(pickle.Unpickler):
    """Resolves only the globals of the allow-list, so that no other code runs."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_NAMES or (module, name) in _user_safe:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"weights_only load refused the global {module}.{name}: only tensors, containers, "
            "numbers, strings and NumPy arrays load this way. If you trust the file, load it "
            "with weights_only=False, or allow the class with "
            "anygpu.serialization.add_safe_globals.")


# ---- files -------------------------------------------------------------------------------------
@contextlib.contextmanager
def _opened(f: FileLike, mode: str) -> Iterator[Any]:
    if isinstance(f, (str, os.PathLike)):
        with open(os.fspath(f), mode) as stream:
            yield stream
    elif hasattr(f, "write" if "w" in mode else "read"):
        yield f  # the caller's file object: left open, at the end of what was read or written
    else:
        raise TypeError(f"expected a path or a binary file object, got {type(f).__name__}")


def _describe(f: FileLike) -> str:
    if isinstance(f, (str, os.PathLike)):
        return os.fspath(f)  # type: ignore[return-value]
    return str(getattr(f, "name", None) or "the file object")


def save(obj: Any, f: FileLike) -> None:
    """Write ``obj`` (tensors, state_dicts, containers, numbers; anything picklable) to a path or
    a binary file object, as ``torch.save``.

    >>> import os, tempfile
    >>> import anygpu as ag
    >>> from anygpu import nn
    >>> model = nn.Linear(3, 2)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
    >>> ag.save({"model": model.state_dict(), "epoch": 5}, path)
    >>> ckpt = ag.load(path)
    >>> nn.Linear(3, 2).load_state_dict(ckpt["model"]), ckpt["epoch"]
    (<All keys matched successfully>, 5)
    """
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(obj, protocol=PROTOCOL, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    crc = zlib.crc32(payload)
    for view in views:
        crc = zlib.crc32(view, crc)
    head = _HEAD.pack(MAGIC, VERSION, len(payload), len(views))
    lengths = struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views))
    with _opened(f, "wb") as out:
        out.write(head + lengths)
        out.write(payload)
        for view in views:
            out.write(view)
        out.write(_TAIL.pack(crc, END))


class _Reader:
    """Exact reads from a stream, with the file's name in the errors."""

    def __init__(self, stream: Any, name: str, prefix: bytes = b""):
        self.stream, self.name, self.prefix = stream, name, prefix
        self.left: int | None = None  # bytes after the prefix, where the stream can tell
        with contextlib.suppress(AttributeError, OSError, ValueError):
            if stream.seekable():
                here = stream.tell()
                self.left = stream.seek(0, io.SEEK_END) - here
                stream.seek(here)

    def truncated(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.name}: the anygpu checkpoint is truncated (it ends "
                               f"inside {what})")

    def check_room(self, nbytes: int, what: str) -> None:
        """Fail before allocating when the stream is known to be shorter (a damaged length)."""
        if self.left is not None and nbytes > self.left + len(self.prefix):
            raise self.truncated(what)

    def read(self, nbytes: int, what: str) -> bytearray:
        self.check_room(nbytes, what)
        out = bytearray(self.prefix[:nbytes])
        self.prefix = self.prefix[nbytes:]
        from_stream = nbytes - len(out)
        while len(out) < nbytes:
            chunk = self.stream.read(min(nbytes - len(out), _CHUNK))
            if not chunk:
                raise self.truncated(what)
            out += chunk
        if self.left is not None:
            self.left -= from_stream
        return out


def _read_anygpu(reader: _Reader) -> tuple[bytes, list[bytearray]]:
    head = reader.read(_HEAD.size, "its header")
    _, version, payload_size, count = _HEAD.unpack(head)
    if version > VERSION:
        raise CheckpointError(f"{reader.name}: checkpoint format {version} is newer than this "
                              f"anygpu reads ({VERSION}); update anygpu")
    reader.check_room(8 * count, "its header")
    lengths = struct.unpack(f"<{count}Q", reader.read(8 * count, "its header"))
    reader.check_room(payload_size + sum(lengths) + _TAIL.size, "its data")
    payload = bytes(reader.read(payload_size, "its pickle stream"))
    buffers = [reader.read(n, f"tensor data {k}") for k, n in enumerate(lengths)]
    crc, end = _TAIL.unpack(reader.read(_TAIL.size, "its end mark"))
    if end != END:
        raise CheckpointError(f"{reader.name}: the anygpu checkpoint is damaged (no end mark)")
    expected = zlib.crc32(payload)
    for buf in buffers:
        expected = zlib.crc32(buf, expected)
    if crc != expected:
        raise CheckpointError(f"{reader.name}: the anygpu checkpoint is damaged (checksum "
                              "mismatch)")
    return payload, buffers


def _foreign(head: bytes, name: str) -> str:
    """What the file is when it is not an anygpu checkpoint: "torch", or an error message."""
    if head.startswith(b"PK\x03\x04") or head.startswith(_TORCH_LEGACY):
        return "torch"
    if not head:
        return f"{name} is empty, not an anygpu checkpoint"
    if MAGIC.startswith(head):
        return f"{name}: the anygpu checkpoint is truncated (it ends inside its header)"
    if head.startswith(b"\x93NUMPY"):
        return f"{name} is a NumPy .npy file, not an anygpu checkpoint; read it with numpy.load"
    if len(head) >= 9 and head[8:9] == b"{":
        return (f"{name} looks like a safetensors file, not an anygpu checkpoint; read it with "
                "anygpu.nn.state.load_file")
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return (f"{name} is a plain pickle stream, not an anygpu checkpoint; if you trust it, "
                "read it with pickle.load")
    return f"{name} is not an anygpu checkpoint (it does not start with anygpu's magic bytes)"


def load(f: FileLike, map_location: MapLocation = None, *, weights_only: bool = True) -> Any:
    """Read what ``save`` (or ``torch.save``) wrote, from a path or a binary file object.

    Tensors go back to the devices they were saved from, or where ``map_location`` sends them:
    a device string (``"cpu"``), a dict from saved device strings to others
    (``{"cuda:0": "opencl"}``), or a callable ``(tensor on the cpu, saved device) -> Tensor,
    device string or None``. With ``weights_only`` (the default, as in PyTorch 2.6+) only
    tensors, containers, numbers, strings and NumPy arrays load; ``weights_only=False`` loads any
    pickled object, so use it only for files you trust.

    A file written by ``torch.save`` (recognized by its content) is read with PyTorch, which must
    be installed, and its tensors become anygpu Tensors: float64 as float32, int16 and uint16 as
    int32, uint32 and uint64 as int64, float8 types as float32 (anygpu lacks those types).

    >>> import io
    >>> import anygpu as ag
    >>> f = io.BytesIO()
    >>> ag.save([ag.ones(2, dtype=ag.bfloat16), 7], f)
    >>> _ = f.seek(0)
    >>> ag.load(f, map_location="cpu")
    [tensor([1., 1.], dtype=anygpu.bfloat16), 7]
    """
    placement = _Placement(map_location)
    name = _describe(f)
    with _opened(f, "rb") as stream:
        start = None
        with contextlib.suppress(AttributeError, OSError, ValueError):
            start = stream.tell() if stream.seekable() else None
        head = _read_upto(stream, _HEAD.size)
        if head.startswith(MAGIC):
            payload, buffers = _read_anygpu(_Reader(stream, name, head))
        else:
            what = _foreign(head, name)
            if what != "torch":
                raise CheckpointError(what)
            if start is not None:
                stream.seek(start)
            else:
                stream = io.BytesIO(head + stream.read())
            return _load_torch(stream, name, placement, weights_only)
    unpickler = (_WeightsOnlyUnpickler if weights_only else pickle.Unpickler)(
        io.BytesIO(payload), buffers=buffers)
    token = _LOADING.set(placement)
    try:
        return unpickler.load()
    finally:
        _LOADING.reset(token)


def _read_upto(stream: Any, nbytes: int) -> bytes:
    out = b""
    while len(out) < nbytes:
        chunk = stream.read(nbytes - len(out))
        if not chunk:
            break
        out += chunk
    return out


# ---- files written by torch.save ---------------------------------------------------------------
# torch dtype name -> (the anygpu dtype it becomes, the torch dtype it is cast to on the way)
_FROM_TORCH: dict[str, tuple[DType, str | None]] = {
    "float32": (dt.float32, None), "float16": (dt.float16, None),
    "bfloat16": (dt.bfloat16, None), "int8": (dt.int8, None), "uint8": (dt.uint8, None),
    "int32": (dt.int32, None), "int64": (dt.int64, None), "bool": (dt.bool_, None),
    "float64": (dt.float32, "float32"),
    "int16": (dt.int32, "int32"), "uint16": (dt.int32, "int32"),
    # values of 2**63 and more wrap, as torch's own cast does
    "uint32": (dt.int64, "int64"), "uint64": (dt.int64, "int64"),
    **{f"float8_{kind}": (dt.float32, "float32")
       for kind in ("e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz", "e8m0fnu")},
}


def _load_torch(stream: Any, name: str, placement: _Placement, weights_only: bool) -> Any:
    try:
        import torch
    except ImportError as err:
        raise ImportError(f"{name} was written by torch.save; reading it needs PyTorch "
                          "(pip install torch)") from err
    locations: dict[int, str] = {}

    def keep_on_host(storage: Any, location: str) -> Any:
        # the storages stay on the processor; where each came from is kept for map_location
        locations[storage.data_ptr()] = location
        return storage

    obj = torch.load(stream, map_location=keep_on_host, weights_only=weights_only)
    memo: dict[int, Any] = {}

    def convert(value: Any) -> Any:
        if id(value) in memo:
            return memo[id(value)]
        if isinstance(value, torch.Tensor):
            out: Any = _from_torch_tensor(value, torch, locations, placement)
        elif isinstance(value, dict):
            out = copy.copy(value)  # keeps the class and attributes (an OrderedDict's _metadata)
            for key, item in value.items():
                out[key] = convert(item)
        elif isinstance(value, list):
            out = [convert(item) for item in value]
        elif isinstance(value, tuple):
            items = [convert(item) for item in value]
            out = type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        else:
            return value
        memo[id(value)] = out
        return out

    return convert(obj)


def _from_torch_tensor(value: Any, torch: Any, locations: Mapping[int, str],
                       placement: _Placement) -> Tensor:
    t = value.detach()
    kind = str(t.dtype).removeprefix("torch.")
    if kind not in _FROM_TORCH:
        raise TypeError(f"a torch tensor of dtype {t.dtype} has no anygpu dtype to load as")
    dtype, cast = _FROM_TORCH[kind]
    if cast is not None:
        t = t.to(getattr(torch, cast))
    t = t.resolve_conj().resolve_neg().contiguous()
    if dtype == dt.bfloat16:
        host = t.view(torch.int16).numpy().view(np.uint16)
    else:
        host = t.numpy()
    saved = locations.get(value.untyped_storage().data_ptr(), "cpu")
    from anygpu.nn.module import Parameter  # anygpu.nn imports this module's package first

    cls = Parameter if isinstance(value, torch.nn.Parameter) else Tensor
    out = cls.__new__(cls)
    Tensor.__init__(out, placement.place(host.copy(), dtype, saved),
                    requires_grad=bool(value.requires_grad) and dtype.is_float)
    return out


__all__ = ["save", "load", "add_safe_globals", "safe_globals", "CheckpointError",
           "reduce_tensor"]
