"""The one typed configuration of anygpu.

Every ``ANYGPU_*`` environment variable is declared here, once, with its default and meaning.
Read values through ``anygpu.config.get()``; tests may call ``reload()`` after changing the
environment.

>>> from anygpu import config
>>> config.get().debug >= 0
True
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "anygpu")


@dataclass(frozen=True)
class Config:
    """Settings read from the environment (variable name = ``ANYGPU_`` + field name, upper case)."""

    device: str = ""
    """Default device for new tensors ("cpu", "opencl", "cuda:1", ...). Empty: "cpu"."""
    debug: int = 0
    """1: print each kernel with its time, bytes, GB/s and template. 2: also its source."""
    cache_dir: str = ""
    """Where compiled programs and tuning results live. Empty: the user cache dir."""
    disk_cache: int = 1
    """0 disables the on-disk caches of compiled programs and lowered kernels."""
    tune: int = 0
    """GEMM and convolution kernels on GPUs. 0: a configuration tuned before (on disk) or the
    shape heuristics. 1: time a few configurations of each new kernel and keep the fastest on
    disk. 2: a wider search."""
    cc: str = "cc"
    """The C compiler the cpu backend uses."""
    cpu_threads: int = 0
    """OpenMP threads for the cpu backend. 0: one per core."""
    seed: int = 0
    """Initial seed of the random number generator."""
    webgpu_opengl: int = 0
    """1: webgpu may use an OpenGL adapter (wgpu's fallback without Vulkan; it lacks int64)."""
    subgroups: int = 1
    """0: reductions on GPUs combine their threads' values through local memory alone, even where
    the device has subgroups (warp shuffles, OpenCL's and WebGPU's subgroup operations)."""

    conv_unfold: int = 1
    """Convolutions on GPUs. 0: their products read the input's windows where they lie. 1:
    16-bit and tf32 ones are laid out for the tensor cores, which copy only plain buffers: the
    padded input stored once with its channels innermost (windows summed over the channels),
    or else the windows written out (im2col). 2: exact float32 ones too, for the SIMT
    template."""

    wgmma: int = 1
    """0: float16 and bfloat16 products on Hopper GPUs use the tensor cores through ``mma.sync``
    (as on Ampere) instead of warpgroups (``wgmma``)."""

    check: int = 0
    """1: every kernel that a device other than the processor runs is run by the processor too,
    on the same inputs, and an output that differs raises ``KernelMismatchError`` naming the
    kernel (for a driver or compiler suspected of wrong results; slow). 2: such a kernel warns
    once and the processor's output is used."""

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir or _default_cache_dir())


def _parse(kind: type, text: str) -> object:
    return int(text) if kind is int else text


def _from_env() -> Config:
    values: dict[str, object] = {}
    for f in fields(Config):
        name = "ANYGPU_" + f.name.upper()
        if name in os.environ:
            kind = int if f.type in ("int", int) else str
            try:
                values[f.name] = _parse(kind, os.environ[name])
            except ValueError as err:
                raise ValueError(f"{name}={os.environ[name]!r} is not a valid "
                                 f"{kind.__name__}") from err
    return Config(**values)  # type: ignore[arg-type]


_config: Config | None = None


def get() -> Config:
    """The configuration, read from the environment on first use."""
    global _config
    if _config is None:
        _config = _from_env()
    return _config


def reload() -> Config:
    """Read the environment again (for tests and tools that change it at run time)."""
    global _config
    _config = _from_env()
    return _config


def variables() -> dict[str, str]:
    """Every declared variable with its meaning, for ``anygpu --help`` and the docs."""
    import inspect

    src = inspect.getsource(Config)
    out = {}
    for f in fields(Config):
        marker = f"    {f.name}:"
        start = src.index(marker)
        doc_start = src.index('"""', start) + 3
        out["ANYGPU_" + f.name.upper()] = src[doc_start : src.index('"""', doc_start)]
    return out
