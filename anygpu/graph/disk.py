"""Lowered kernels kept on disk: a new process reads the kernels that earlier ones lowered
instead of lowering them again (building a kernel's AST and its IR took most of a warm first
step: about 1 s of ResNet-18's on a 2-core processor, whose programs the disk cache of compiled
binaries already held).

Entries are pickles under ``<cache>/lowered/<code>/<kind>/``, named by a hash of their key and
holding the key itself, which a read compares. ``<code>`` hashes the package's own source, so a
changed lowering never reads what an older one wrote; the first write of a new code removes the
directories of other codes. A read that fails (a file half-written by a process that died, one
from another Python) is a miss; a write that fails (a read-only cache) is skipped. Nothing is
kept unless ``config.disk_cache`` is on."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from anygpu import config

_code: str | None = None
_made: set[Path] = set()  # directories this process has made (or found) already


def code_hash() -> str:
    """A hash of the package's Python source and of the Python version reading it."""
    global _code
    if _code is None:
        root = Path(__file__).resolve().parent.parent
        digest = hashlib.sha256(repr(sys.version_info[:2]).encode())
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
        _code = digest.hexdigest()[:20]
    return _code


_folders: tuple[Any, str, dict[str, str]] = (None, "", {})  # configuration, code, folders


def _folder(kind: str) -> str:
    """``<cache>/lowered/<code>/<kind>``, worked out once for each configuration read."""
    global _folders
    settings, code = config.get(), code_hash()
    if _folders[0] is not settings or _folders[1] != code:
        _folders = (settings, code, {})
    folder = _folders[2].get(kind)
    if folder is None:
        folder = _folders[2][kind] = os.path.join(settings.cache_path, "lowered", code, kind)
    return folder


def _file(kind: str, key: Any) -> str:
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.fast = True  # no memo: equal keys pickle alike whichever of their objects are shared
    pickler.dump(key)
    return os.path.join(_folder(kind), hashlib.sha256(buf.getvalue()).hexdigest())


def _path(kind: str, key: Any) -> Path:
    return Path(_file(kind, key))


def load(kind: str, key: Any) -> Any | None:
    """The value kept for ``key`` (a tuple of plain values), or None."""
    if not config.get().disk_cache:
        return None
    try:
        with open(_file(kind, key), "rb") as f:
            kept_key, value = pickle.load(f)
    except Exception:  # noqa: BLE001 (missing, half-written or unreadable: a miss)
        return None
    return value if kept_key == key else None


def save(kind: str, key: Any, value: Any) -> None:
    """Keep ``value`` for ``key``; other processes see the whole file or none."""
    if not config.get().disk_cache:
        return
    path = _path(kind, key)
    folder = path.parent
    try:
        if folder not in _made:
            if not folder.parent.is_dir():
                for other in folder.parent.parent.glob("*"):
                    shutil.rmtree(other, ignore_errors=True)  # what older code lowered
            folder.mkdir(parents=True, exist_ok=True)
            _made.add(folder)
        fd, tmp = tempfile.mkstemp(dir=folder)
    except OSError:
        _made.discard(folder)
        return
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump((key, value), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 (a full disk, a value that cannot be pickled: not kept)
        try:
            os.unlink(tmp)
        except OSError:
            pass
