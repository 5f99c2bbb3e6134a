"""The autotuner: for each GEMM or convolution kernel on a GPU (a contraction that a template
computes), time the configurations of the templates that can compute it, keep the fastest on
disk, and use it from then on.

A kernel is known by its contraction (dimensions, the operands' expressions with their layouts
and dtypes, the output's layout), not by its epilogue, so one winner serves a convolution
whether a bias or an activation follows it; the winner is stored under a hash of that with the
backend, the device's name and its driver, in ``<cache dir>/tuning/<backend>/``.
``ANYGPU_TUNE`` sets how hard it searches (``config.tune``): 0 uses a stored winner or the
heuristics and times nothing (the default); 1 times a few tile shapes of each new kernel; 2
searches wider (both templates, k-steps, pipeline depths) and re-tunes kernels tuned at level 1.
``anygpu tune`` pre-tunes the products and convolutions of a model.

Candidates run on the kernel's own inputs into a scratch output, the heuristic configuration
first; one whose result differs from the heuristic one's beyond rounding is discarded, never
chosen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from anygpu import config
from anygpu.codegen import ir, lower
from anygpu.codegen.render.cstyle import render
from anygpu.codegen.render.wgsl import launch_groups
from anygpu.codegen.templates.gemm import GemmOptions
from anygpu.codegen.templates.mma import MmaOptions
from anygpu.dtype import DType, float32
from anygpu.runtime.base import Buffer, Device, Program

VERSION = 2  # part of every key: a change of the templates' parameters invalidates old winners


@dataclass
class Record:
    """One kernel tuned in this process (``anygpu tune`` reports them)."""

    name: str
    configurations: int  # timed (after compile failures and wrong results are left out)
    default_s: float
    best_s: float
    best: str  # the winner's description
    seconds: float  # compiling and timing, all candidates
    rejected: list[str] = dataclasses.field(default_factory=list)  # why candidates fell out


records: list[Record] = []
reused = 0  # kernels that took a winner found on disk or in memory instead of being timed
on_record: Callable[[Record], None] | None = None  # called after each kernel is tuned
deadline: float | None = None  # time.monotonic() after which nothing more is timed
forced: int | None = None  # a level that overrides ANYGPU_TUNE (``anygpu tune --level``)

_memory: dict[str, tuple[int, Any]] = {}  # key -> (level, options or None for the default)


def level() -> int:
    """How hard to search now: ``forced`` or ``ANYGPU_TUNE``, and 0 once the deadline has
    passed."""
    if deadline is not None and time.monotonic() > deadline:
        return 0
    return max(0, min(config.get().tune if forced is None else forced, 2))


def _key(device: Device, ast: lower.KernelAST, features: dict) -> str:
    """The kernel's identity for tuning: the device, and the contraction without its epilogue
    (the dimensions, the operands' expressions, the output's layout and dtypes), so that a
    winner serves every kernel around the same product (a convolution followed by a bias,
    an activation or nothing)."""
    info = device.info
    names: dict[str, str] = {}
    memo: dict[int, str] = {}

    def text(e: ir.Expr) -> str:
        hit = memo.get(id(e))
        if hit is None:
            arg = e.arg
            if e.op == "load":  # buffers by order of appearance: the epilogue's inputs shift them
                arg = names.setdefault(e.arg, f"b{len(names)}")
            hit = memo[id(e)] = f"{e.op}:{e.dtype.name}:{arg}({','.join(map(text, e.srcs))})"
        return hit

    stage = ast.stages[0]
    parts = [str(VERSION), device.backend, info.name, info.driver, repr(ast.dims),
             stage.op.name, stage.dtype.name, text(stage.value), text(ast.out_index),
             ast.output.dtype.name, ast.index_dtype.name,
             # the templates do not read "subgroup" (reductions do)
             repr(sorted((k, str(v)) for k, v in features.items() if k != "subgroup"))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _path(device: Device, key: str) -> str:
    return os.path.join(config.get().cache_path, "tuning", device.backend, key + ".json")


def _encode(options: Any) -> dict | None:
    if options is None:
        return None
    kind = "mma" if isinstance(options, MmaOptions) else "gemm"
    return {"template": kind, **dataclasses.asdict(options)}


def _decode(data: Any) -> Any:
    kinds: dict[str, type[MmaOptions] | type[GemmOptions]] = {"mma": MmaOptions,
                                                              "gemm": GemmOptions}
    kind = kinds.get(data.get("template", ""))
    if kind is None:
        raise ValueError(f"unknown template {data.get('template')!r}")
    fields = {f.name for f in dataclasses.fields(kind)}
    return kind(**{k: v for k, v in data.items() if k in fields})


def _stored(device: Device, key: str) -> tuple[int, Any] | None:
    hit = _memory.get(key)
    if hit is not None or not config.get().disk_cache:
        return hit
    try:
        with open(_path(device, key)) as f:
            data = json.load(f)
        options = data["options"]
        hit = (int(data["level"]), None if options is None else _decode(options))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # never tuned, or a damaged file: tuned again
    _memory[key] = hit
    return hit


def _store(device: Device, key: str, tuned_level: int, options: Any, record: Record) -> None:
    _memory[key] = (tuned_level, options)
    if not config.get().disk_cache:
        return
    data = {"level": tuned_level, "options": _encode(options), "kernel": record.name,
            "best": record.best, "best_us": record.best_s * 1e6,
            "default_us": record.default_s * 1e6, "configurations": record.configurations}
    path = _path(device, key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache directory: the winner lasts for this process


def _loads_b0(stmt: Any) -> bool:
    """Whether ``stmt`` reads the kernel's own output buffer (an in-place write): timed into a
    scratch buffer it would read that buffer's garbage."""
    seen: set[int] = set()

    def expr(e: Any) -> bool:
        if not isinstance(e, ir.Expr) or id(e) in seen:
            return False
        seen.add(id(e))
        return (e.op == "load" and e.arg == "b0") or any(expr(s) for s in e.srcs)

    def walk(s: Any) -> bool:
        if isinstance(s, ir.Expr):
            return expr(s)
        if isinstance(s, (list, tuple)):
            return any(walk(x) for x in s)
        if dataclasses.is_dataclass(s):
            return any(walk(getattr(s, f.name)) for f in dataclasses.fields(s))
        return False

    return walk(stmt)


def choose(device: Device, ast: lower.KernelAST, kernel: ir.Kernel, source: str,
           features: dict, inputs: Sequence[Buffer]) -> tuple[ir.Kernel, str]:
    """The kernel (and its source) in the configuration to run: a stored winner, one found now
    by timing the candidates on ``inputs`` (``ANYGPU_TUNE`` 1 or 2), or ``kernel`` itself."""
    key = _key(device, ast, features)
    want = level()
    hit = _stored(device, key)
    if hit is not None and (want == 0 or hit[0] >= want):
        global reused
        reused += 1
        return _build(device, ast, features, hit[1]) if hit[1] is not None else (kernel, source)
    out_dtype = ast.output.dtype
    if want == 0 or not out_dtype.is_float or any(_loads_b0(s) for s in kernel.body):
        return kernel, source
    candidates = lower.template_options(ast, device.dialect, device.info.max_local_size,
                                        features, want)
    if len(candidates) < 2:
        return kernel, source
    return _search(device, ast, kernel, source, features, inputs, candidates, key, want)


def _build(device: Device, ast: lower.KernelAST, features: dict,
           options: Any) -> tuple[ir.Kernel, str]:
    kernel = lower.to_ir(ast, device.dialect, device.info.max_local_size, features, options)
    return kernel, render(kernel, device.dialect, features)


def _groups(device: Device, kernel: ir.Kernel) -> tuple[int, ...]:
    return launch_groups(kernel.groups) if device.dialect == "wgsl" else (kernel.groups,)


def _tolerance(dtype: DType, features: dict) -> float:
    """How far, relative to the largest output, a candidate may differ from the heuristic
    configuration's result (summation order and rounding differ between tilings)."""
    if dtype == float32 and not features.get("tf32", False):
        return 1e-3
    return 3e-2


def _search(device: Device, ast: lower.KernelAST, kernel: ir.Kernel, source: str,
            features: dict, inputs: Sequence[Buffer], candidates: list[Any], key: str,
            want: int) -> tuple[ir.Kernel, str]:
    from anygpu.graph.schedule import alloc_for, buffer_to_host  # schedule imports this module

    start = time.monotonic()
    node = ast.output
    built: list[tuple[Any, ir.Kernel, str]] = [(candidates[0], kernel, source)]
    rejected: list[str] = []
    for options in candidates[1:]:
        try:
            built.append((options, *_build(device, ast, features, options)))
        except Exception as err:  # noqa: BLE001 (a configuration the shape cannot take)
            rejected.append(f"{options.describe()}: {err or type(err).__name__}")
    device.prebuild([(src, k.name) for _, k, src in built])
    scratch = alloc_for(device, node.numel, node.dtype)
    buffers = [scratch, *inputs]
    reference: np.ndarray | None = None
    reps, budget = (10, 0.05) if want < 2 else (30, 0.2)
    timed: list[tuple[float, Any, ir.Kernel, str]] = []
    for options, k, src in built:
        try:
            program: Program = device.program(src, k.name)
            first = program(buffers, _groups(device, k), (k.local,), wait=True) or 0.0
        except Exception as err:  # noqa: BLE001 (too many registers, too much shared memory...)
            if reference is None:
                return kernel, source  # the heuristic choice itself fails: leave it to report
            rejected.append(f"{options.describe()}: {type(err).__name__}: {err}")
            continue
        result = buffer_to_host(scratch, device, node.numel, node.dtype).astype(np.float64)
        if reference is None:
            reference = result
        elif not _close(result, reference, _tolerance(node.dtype, features)):
            rejected.append(f"{options.describe()}: result differs from the heuristic one's")
            continue
        if timed and first > 4 * min(t for t, *_ in timed):
            continue  # far behind: not worth timing further
        times = [first]
        while len(times) < reps and sum(times) < budget:
            times.append(program(buffers, _groups(device, k), (k.local,), wait=True) or 0.0)
        timed.append((statistics.median(times), options, k, src))
    best_s, best, k, src = min(timed, key=lambda t: t[0])
    # as built: the lowering may have dropped a part the device cannot take (a double buffer
    # beyond its local memory)
    record = Record(kernel.name, len(timed), timed[0][0], best_s,
                    k.meta.get("options", best).describe(),
                    time.monotonic() - start, rejected)
    _store(device, key, want, None if best is candidates[0] else best, record)
    records.append(record)
    if config.get().debug >= 1:
        print(f"tuned {kernel.name}: {len(timed)} configurations in {record.seconds:.1f} s, "
              f"{best_s * 1e6:.1f} us ({timed[0][0] / best_s:.2f}x the heuristic choice): "
              f"{best.describe()}", file=sys.stderr)
        for why in rejected:
            print(f"  left out {why}", file=sys.stderr)
        if config.get().debug >= 2:  # every configuration's time, fastest first
            for seconds, options, _, _ in sorted(timed, key=lambda t: t[0]):
                print(f"  {seconds * 1e6:9.1f} us  {options.describe()}", file=sys.stderr)
    if on_record is not None:
        on_record(record)
    return k, src


def _close(got: np.ndarray, want: np.ndarray, rtol: float) -> bool:
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got)):
        return False
    if not finite.any():
        return True
    scale = float(np.abs(want[finite]).max())
    return float(np.abs(got[finite] - want[finite]).max()) <= rtol * scale + 1e-6
